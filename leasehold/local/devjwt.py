"""A development token issuer for the shipped gateway configurations.

Every configuration under ``deploy/gateways/`` takes the caller's identity from a verified bearer
token (a JWT signed by your identity provider), never from a header the client sent: Envoy
verifies it itself (``jwt_authn`` with a local JWKS), nginx and Traefik let the agent's forward
auth verify it (``--authz-jwks``). Production points both at the identity provider's public keys.
For ``make run``, the end-to-end tests, the benchmark and a compose or dev-cluster trial,
:class:`DevIssuer` plays that provider: one ES256 (P-256) key pair, its public half written as a
JWKS file, and tokens with the claims the configurations read. The pair is made in memory, or
read from the key file ``leasehold secrets generate`` writes (``dev-idp.key``, with its
``jwks.json``), from which ``leasehold token`` mints a client's token. Its key id starts with
``dev-``: a JWKS or token carrying one is this development provider's, never a production one's.

Claims: ``iss`` and ``aud`` (checked by every verifier), ``sub`` (the user id), ``tenant`` (the
tenant id) and, optionally, ``api_key`` (the API key id), ``exp``/``iat``.

PyJWT signs (``jwt.encode``) and the public key is exported with ``jwt.algorithms.ECAlgorithm``;
nothing else of the library is used here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

ISSUER = "https://issuer.leasehold.example"
AUDIENCE = "leasehold-api"
ALGORITHM = "ES256"


class DevKeyError(Exception):
    """A development key file that is missing or is not a P-256 private key (the CLI prints it)."""


def key_id(key: ec.EllipticCurvePrivateKey) -> str:
    """``dev-`` and the first 16 characters of the public key's JWK thumbprint (RFC 7638): the
    same key always gets the same id, in the JWKS and in every token."""
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    canonical = json.dumps({k: jwk[k] for k in ("crv", "kty", "x", "y")}, separators=(",", ":"), sort_keys=True)
    digest = base64.urlsafe_b64encode(hashlib.sha256(canonical.encode()).digest()).rstrip(b"=").decode()
    return "dev-" + digest[:16]


@dataclass
class DevIssuer:
    """Signs tokens for a JWKS it writes. ``kid`` names the key in the JWKS and in every token
    (default: :func:`key_id`)."""

    issuer: str = ISSUER
    audience: str = AUDIENCE
    kid: str = ""
    key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

    def __post_init__(self) -> None:
        if not self.kid:
            self.kid = key_id(self.key)

    @classmethod
    def from_key_file(cls, path: Path, *, issuer: str = ISSUER, audience: str = AUDIENCE) -> DevIssuer:
        """The issuer of a key file :meth:`write_key` wrote (``dev-idp.key``)."""
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except FileNotFoundError:
            raise DevKeyError(f"no development identity provider key at {path}: run leasehold secrets generate "
                              f"--out DIR, or name the key with --key") from None
        except (OSError, ValueError, TypeError) as e:
            raise DevKeyError(f"{path} is not an unencrypted PEM private key: {e}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
            raise DevKeyError(f"{path} is not a P-256 (ES256) private key")
        return cls(issuer=issuer, audience=audience, key=key)

    def write_key(self, path: Path) -> Path:
        """The private key as unencrypted PKCS#8 PEM, mode 0600 (created, never replaced)."""
        pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return path

    def jwks(self) -> dict:
        jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        jwk.update(kid=self.kid, alg=ALGORITHM, use="sig")
        return {"keys": [jwk]}

    def write_jwks(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.jwks()))
        return path

    def token(self, user: str, tenant: str, api_key: str | None = None, *, ttl_s: int = 86_400,
              **extra: object) -> str:
        now = int(time.time())
        claims: dict[str, object] = {"iss": self.issuer, "aud": self.audience, "sub": user, "tenant": tenant,
                                     "iat": now, "exp": now + ttl_s}
        if api_key is not None:
            claims["api_key"] = api_key
        claims.update(extra)
        return jwt.encode(claims, self.key, algorithm=ALGORITHM, headers={"kid": self.kid})

    def bearer(self, user: str, tenant: str, api_key: str | None = None, **kw: object) -> dict[str, str]:
        """The ``Authorization`` header of a client holding that identity."""
        return {"authorization": "Bearer " + self.token(user, tenant, api_key, **kw)}

    def values(self, jwks_file: Path) -> dict[str, object]:
        """The placeholders the gateway configurations take for this issuer."""
        return {"JWKS_FILE": jwks_file, "JWT_ISSUER": self.issuer, "JWT_AUDIENCE": self.audience}


__all__ = ["ALGORITHM", "AUDIENCE", "ISSUER", "DevIssuer", "DevKeyError", "key_id"]
