"""``leasehold token``: a client's bearer token from the development identity provider, for trying
a deployment's gateway (compose's Envoy, or one in a dev cluster) by hand::

    leasehold secrets generate --out deploy/secrets        # writes dev-idp.key and jwks.json
    TOKEN=$(leasehold token --tenant atlas --user U-17)
    curl -i localhost:10000/catalog -H "authorization: Bearer $TOKEN"

It signs with the key ``leasehold secrets generate`` wrote (``dev-idp.key``), whose public half
is the ``jwks.json`` the gateway verifies against, through :class:`leasehold.local.devjwt.DevIssuer` —
the same code that mints the tokens of ``make run``'s demo clients and of the end-to-end tests.
Development only: in production your identity provider issues the tokens and publishes the JWKS.
Registered by :func:`register` from ``leasehold.commands.cli``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jwt

from kernel.ids import TENANT_RE, human

from ..local.devjwt import AUDIENCE, ISSUER, DevIssuer, DevKeyError
from .output import Exit, Failure, out

DEFAULT_KEY = Path("deploy") / "secrets" / "dev-idp.key"  # compose's secrets directory, from the checkout's root
MAX_ID = 256  # the agent's limit on a principal or API key id
MAX_TTL_S = 7 * 86_400


def cmd_token(args: argparse.Namespace) -> int:
    if not TENANT_RE.match(args.tenant):
        raise Failure(Exit.USAGE, f"--tenant must match {human(TENANT_RE.pattern)}: {args.tenant!r}")
    for name, value in (("--user", args.user), ("--api-key", args.api_key)):
        if value is not None and not 1 <= len(value) <= MAX_ID:
            raise Failure(Exit.USAGE, f"{name} must be 1 to {MAX_ID} characters")
    if not 1 <= args.ttl_s <= MAX_TTL_S:
        raise Failure(Exit.USAGE, f"--ttl-s must be within 1..{MAX_TTL_S}: {args.ttl_s}")
    try:
        issuer = DevIssuer.from_key_file(Path(args.key), issuer=args.issuer, audience=args.audience)
    except DevKeyError as e:
        raise Failure(Exit.USAGE, str(e)) from None
    token = issuer.token(args.user, args.tenant, args.api_key, ttl_s=args.ttl_s)
    claims = jwt.decode(token, options={"verify_signature": False})
    data: dict[str, Any] = {"token": token, "kid": issuer.kid, "claims": claims,
                            "expiresAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claims["exp"]))}
    return out(args).result(data, lambda d: d["token"])  # text: the token alone, for TOKEN=$(...)


def register(sub: Any, command: Any) -> None:
    """Add ``leasehold token`` (``command(sub, name, help, func)``: the CLI's subcommand factory)."""
    sp = command(sub, "token", "a client's bearer token signed by the development identity provider's key "
                               "(leasehold secrets generate writes it): for trying a gateway, never production",
                 cmd_token)
    sp.add_argument("--tenant", required=True, help="the tenant claim, e.g. atlas")
    sp.add_argument("--user", required=True, help="the user id (the sub claim), e.g. U-17")
    sp.add_argument("--api-key", help="the API key id (the api_key claim; default: none)")
    sp.add_argument("--key", default=str(DEFAULT_KEY),
                    help=f"the development key leasehold secrets generate wrote (default: {DEFAULT_KEY})")
    sp.add_argument("--ttl-s", type=int, default=3600, help="lifetime in seconds (default: 3600)")
    sp.add_argument("--issuer", default=ISSUER, help=f"the iss claim (default: {ISSUER}, compose's JWT_ISSUER)")
    sp.add_argument("--audience", default=AUDIENCE,
                    help=f"the aud claim (default: {AUDIENCE}, compose's JWT_AUDIENCE)")


__all__ = ["cmd_token", "register"]
