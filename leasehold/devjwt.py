"""A development token issuer for the shipped gateway configurations.

Every configuration under ``deploy/gateways/`` takes the caller's identity from a verified bearer
token (a JWT signed by your identity provider), never from a header the client sent: Envoy
verifies it itself (``jwt_authn`` with a local JWKS), nginx and Traefik let the agent's forward
auth verify it (``--authz-jwks``). Production points both at the identity provider's public keys.
For ``make run``, the end-to-end tests and the benchmark, :class:`DevIssuer` plays that
provider: one ES256 (P-256) key pair made in memory, its public half written as a JWKS file, and
tokens with the claims the configurations read.

Claims: ``iss`` and ``aud`` (checked by every verifier), ``sub`` (the user id), ``tenant`` (the
tenant id) and, optionally, ``api_key`` (the API key id), ``exp``/``iat``.

PyJWT signs (``jwt.encode``) and the public key is exported with ``jwt.algorithms.ECAlgorithm``;
nothing else of the library is used here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

ISSUER = "https://issuer.leasehold.example"
AUDIENCE = "leasehold-api"
ALGORITHM = "ES256"


@dataclass
class DevIssuer:
    """Signs tokens for a JWKS it writes. ``kid`` names the key in the JWKS and in every token."""

    issuer: str = ISSUER
    audience: str = AUDIENCE
    kid: str = "dev-1"
    key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

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


__all__ = ["ALGORITHM", "AUDIENCE", "ISSUER", "DevIssuer"]
