"""``leasehold secrets generate --out DIR``: every credential a deployment needs, as files that
``deploy/docker-compose.yml`` mounts and ``deploy/k8s-dev`` turns into Secrets (the
production base reads Secrets of the same keys; docs/deployment.md lists them).

=============================  ======================================================================
file                           what it is
=============================  ======================================================================
gateway.token                  the gateways' bearer token to the agents (Envoy, nginx, Traefik)
operator.token                 the operators' bearer token (``/v1/leases``, ``/v1/policy``)
region-<r>.token               region r's bearer token to the allocator (its agents send it)
gateway-token-hashes           ``gateway:<sha256>`` — what the agents are configured with
operator-token-hashes          ``operator:<sha256>``
region-token-hashes            ``<r>:<sha256>`` per line — what the allocators are configured with
pepper                         the agents' HMAC key for principal ids in Redis keys
redis-admin.password           Redis's ``default`` user (administration only)
redis-agent.password           Redis's ``agent`` user (its scripts on ``rl:*`` keys)
redis-users.acl                both users as a Redis ACL file (``--aclfile``)
etcd-<user>.password           root, publisher, allocator, agent (deploy/etcd/leasehold-roles.sh)
policy-signing.key / .pub      the Ed25519 pair that signs policy bundles (the key stays with you)
dev-idp.key                    FOR DEVELOPMENT: a stand-in identity provider's ES256 signing key;
                               ``leasehold token`` signs client tokens with it (never mounted)
jwks.json                      FOR DEVELOPMENT: that key's public half, the JWKS compose's Envoy
                               verifies bearer tokens against (``JWKS_FILE``'s default). In
                               production the JWKS is your identity provider's, and so are the keys
=============================  ======================================================================

Services store only digests of the tokens. An existing file is never replaced (``--force``
replaces them all): re-running the command cannot swap a deployment's credentials by accident.
The directory is 0700; the private keys 0600; the other files 0644 so that containers
running as their own user (uid 10001) can read them through a bind mount — the directory keeps
them from other users of the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from kernel.ids import REGION, REGION_RE, human
from kernel.signing import generate_keypair

from ..local.devjwt import DevIssuer
from ..local.procs import ETCD_USERS, agent_acl

# what ``generate`` writes, for any regions the services accept (a directory holding only these is
# the credentials' own)
CREDENTIAL_RE = re.compile(rf"(gateway|operator|region-{human(REGION)})\.token\Z|"
                           r"(gateway|operator|region)-token-hashes\Z|pepper\Z|redis-(admin|agent)\.password\Z|"
                           r"redis-users\.acl\Z|etcd-[a-z]+\.password\Z|policy-signing\.(key|pub)\Z|"
                           r"dev-idp\.key\Z|jwks\.json\Z")


class SecretsError(Exception):
    """A refusal of ``generate`` (bad arguments, files already there): the CLI prints it."""


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def file_names(regions: tuple[str, ...]) -> list[str]:
    """Every file ``generate`` writes for ``regions``, in a stable order."""
    names = ["gateway.token", "operator.token", *(f"region-{r}.token" for r in regions),
             "gateway-token-hashes", "operator-token-hashes", "region-token-hashes", "pepper",
             "redis-admin.password", "redis-agent.password", "redis-users.acl",
             *(f"etcd-{u}.password" for u in ETCD_USERS), "policy-signing.key", "policy-signing.pub",
             "dev-idp.key", "jwks.json"]
    return names


@dataclass(frozen=True)
class Generated:
    dir: Path
    files: list[Path]


def generate(out: Path, regions: tuple[str, ...] = ("eu", "us"), *, force: bool = False) -> Generated:
    """Write the credentials into ``out`` (created 0700). Refuses when any of them exists,
    unless ``force``."""
    if not regions or len(set(regions)) != len(regions) or not all(REGION_RE.match(r) for r in regions):
        raise SecretsError(f"regions must be distinct names matching {human(REGION)}: {','.join(regions)!r}")
    if out.exists() and not out.is_dir():
        raise SecretsError(f"{out} is not a directory")
    existing = [n for n in file_names(regions) if (out / n).exists()]
    if existing and not force:
        raise SecretsError(f"{out} already holds {', '.join(existing)}: refusing to replace credentials "
                           f"(--force replaces them all)")
    if out.is_dir() and out.stat().st_mode & 0o077:
        others = sorted(p.name for p in out.iterdir() if not CREDENTIAL_RE.match(p.name))
        if others:  # never narrow the mode of a directory that holds other things (a checkout, /tmp, a home)
            raise SecretsError(f"{out} is open to other users and holds other files ({', '.join(others[:3])}"
                               f"{', ...' if len(others) > 3 else ''}): the credentials need a directory of their "
                               f"own (a new one is created 0700)")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    written: list[Path] = []

    def put(name: str, text: str) -> None:
        path = out / name
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        path.chmod(0o644)  # whatever the umask: readable by a container's own user (see the module doc)
        written.append(path)

    def token() -> str:  # single values are written without a newline (etcdctl reads passwords raw)
        return secrets.token_urlsafe(32)

    gateway, operator = token(), token()
    region_tokens = {r: token() for r in regions}
    put("gateway.token", gateway)
    put("operator.token", operator)
    for r, t in region_tokens.items():
        put(f"region-{r}.token", t)
    put("gateway-token-hashes", f"gateway:{_sha(gateway)}\n")
    put("operator-token-hashes", f"operator:{_sha(operator)}\n")
    put("region-token-hashes", "".join(f"{r}:{_sha(t)}\n" for r, t in region_tokens.items()))
    put("pepper", token())
    admin, agent = token(), token()
    put("redis-admin.password", admin)
    put("redis-agent.password", agent)
    put("redis-users.acl", f"user default on >{admin} ~* &* +@all\nuser {agent_acl('agent', agent)}\n")
    for user in ETCD_USERS:
        put(f"etcd-{user}.password", token())
    for name in ("policy-signing.key", "policy-signing.pub"):
        (out / name).unlink(missing_ok=True)
    key, pub = generate_keypair(out, "policy-signing")  # the key 0600, never mounted into a service
    pub.chmod(0o644)
    written += [key, pub]
    # a stand-in identity provider for trying the stack (module doc): its key 0600, its JWKS
    idp = DevIssuer()
    (out / "dev-idp.key").unlink(missing_ok=True)
    written.append(idp.write_key(out / "dev-idp.key"))
    put("jwks.json", json.dumps(idp.jwks(), indent=2) + "\n")
    return Generated(out, written)


__all__ = ["Generated", "SecretsError", "file_names", "generate"]
