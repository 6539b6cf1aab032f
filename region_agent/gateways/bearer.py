"""The caller's identity from a verified bearer token, for forward auth (``/v1/authz``).

nginx and Traefik cannot verify a JWT themselves (their open-source builds have no such
module), so the configurations under ``deploy/gateways/`` hand the client's ``Authorization``
header to the agent untouched and the agent verifies it (``--authz-jwks FILE``): then no
header a client sends can name a tenant, a user or an API key — only a token signed by the
identity provider can. Envoy verifies tokens itself (``jwt_authn``) and hands the agent headers.

:class:`BearerVerifier` checks the signature against the JWKS file (asymmetric algorithms only:
RS*, PS*, ES*, EdDSA — never ``none`` or a shared secret), ``iss``, ``aud``, ``exp`` and ``nbf``
(``--authz-jwt-leeway-s`` of clock skew), and reads the identity from the claims
(``--authz-jwt-claims``; by default ``tenant``, ``sub`` as the user and ``api_key``). A missing,
malformed, expired, wrongly signed token or one without a tenant and a user claim is *no
identity*: the forward-auth door then asks the question of a failed authentication (the
caller's address alone) and answers 401 if that address may still knock. Every failure looks
the same to the caller (an unknown key and a bad signature are not told apart).

The JWKS file is read again when it changes (checked at most once a second), so a key rotation
at the identity provider needs no restart. The library (PyJWT) is used through its public API
only: ``jwt.PyJWKSet`` for the keys and ``jwt.decode`` with explicit algorithms.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from typing import NamedTuple

import jwt

from .mapping import parse_names

log = logging.getLogger(__name__)

ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
DEFAULT_CLAIMS = {"tenant": "tenant", "user": "sub", "api_key": "api_key"}
MAX_TOKEN_CHARS = 8_192  # longer is not a token we verify (bounded work per request)
# ``Authorization: Bearer <token>`` as RFC 6750 (2.1) spells it: the scheme in any case (RFC 9110
# 11.1), one or more spaces, the token (b64token), nothing else; so a client's token is read the same
# however it spells the scheme or spaces it, here and at the shipped Envoys (deploy/gateways)
CREDENTIALS = re.compile(r"[ \t]*bearer +([A-Za-z0-9\-._~+/]+=*)[ \t]*\Z", re.IGNORECASE)
RELOAD_CHECK_S = 1.0


class Identity(NamedTuple):
    tenant: str
    user: str
    api_key: str | None


class BearerVerifier:
    def __init__(self, jwks_file: str, *, issuer: str, audience: str, claims: Iterable[str] = (),
                 leeway_s: int = 30, clock=time.monotonic):
        self.path = jwks_file
        self.issuer = issuer
        self.audience = audience
        self.claims = parse_names(claims, DEFAULT_CLAIMS, re.compile(r"[A-Za-z0-9_.:-]{1,64}"), "authz jwt claim")
        self.leeway = leeway_s
        self.clock = clock
        self._mtime = -1.0
        self._checked = -1e18
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._load()  # a missing or malformed file is a settings error at start (ValueError)

    def _load(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
            with open(self.path, "rb") as f:
                keyset = jwt.PyJWKSet.from_json(f.read().decode("utf-8"))
        except (OSError, UnicodeDecodeError, jwt.PyJWTError, ValueError) as e:
            raise ValueError(f"--authz-jwks {self.path}: not a readable JWKS with a usable public key ({e})") from None
        keys: dict[str | None, jwt.PyJWK] = {}
        for k in keyset.keys:
            if k.algorithm_name not in ASYMMETRIC:
                continue  # a shared secret in a JWKS is never used
            keys[k.key_id] = k
        if not keys:
            raise ValueError(f"--authz-jwks {self.path}: no asymmetric public key")
        if len(keys) == 1:
            keys.setdefault(None, next(iter(keys.values())))  # a token without kid: the only key
        self._keys, self._mtime = keys, mtime

    def _maybe_reload(self) -> None:
        now = self.clock()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            if os.stat(self.path).st_mtime != self._mtime:
                self._load()
                log.info("authz JWKS %s reloaded (%d keys)", self.path, len(self._keys))
        except (OSError, ValueError) as e:
            log.warning("authz JWKS %s not reloaded, keeping the keys in use: %s", self.path, e)

    def identity(self, authorization: str | None) -> Identity | None:
        """The identity of ``Authorization: Bearer <jwt>``, or None (no identity, whatever the reason)."""
        if not authorization or len(authorization) > MAX_TOKEN_CHARS + 64:
            return None
        m = CREDENTIALS.match(authorization)
        if m is None:
            return None
        token = m.group(1)
        self._maybe_reload()
        try:
            kid = jwt.get_unverified_header(token).get("kid")
            key = self._keys.get(kid if isinstance(kid, str) else None)
            if key is None:
                return None
            # the key's own algorithm only (no algorithm confusion)
            claims = jwt.decode(token, key.key, algorithms=[key.algorithm_name], audience=self.audience,
                                issuer=self.issuer, leeway=self.leeway,
                                options={"require": ["exp", "iss", "aud"]})
        except (jwt.PyJWTError, ValueError, TypeError):
            return None
        tenant, user = claims.get(self.claims["tenant"]), claims.get(self.claims["user"])
        api_key = claims.get(self.claims["api_key"])
        if not isinstance(tenant, str) or not isinstance(user, str) or not tenant or not user:
            return None
        return Identity(tenant, user, api_key if isinstance(api_key, str) and api_key else None)


__all__ = ["ASYMMETRIC", "DEFAULT_CLAIMS", "BearerVerifier", "Identity"]
