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
etcd-ca.crt                    the CA that signed etcd's certificate: every etcd client verifies etcd
                               with it (the allocators, the agents, the roles Job, ``leasehold policy``)
etcd-ca.key                    that CA's private key (stays with you: it signs a renewed certificate)
etcd-server.crt / .key         etcd's certificate (client and peer port) for the members
                               ``etcd-0..2`` of deploy/docker-compose.yml and deploy/k8s-dev
                               (``etcd-N.etcd``, ``etcd-N.etcd.leasehold.svc[.cluster.local]``),
                               ``localhost`` and ``127.0.0.1`` (a port-forward); the key is etcd's only
dev-idp.key                    FOR DEVELOPMENT: a stand-in identity provider's ES256 signing key;
                               ``leasehold token`` signs client tokens with it (never mounted)
jwks.json                      FOR DEVELOPMENT: that key's public half, the JWKS compose's Envoy
                               verifies bearer tokens against (``JWKS_FILE``'s default). In
                               production the JWKS is your identity provider's, and so are the keys
=============================  ======================================================================

Services store only digests of the tokens. An existing file is never replaced (``--force``
replaces them all): re-running the command cannot swap a deployment's credentials by accident.
All or nothing: a run that fails or is interrupted leaves the directory as it was (the files
are written apart first and moved into place only when every one of them is written).
The directory is 0700; the private keys 0600; the other files 0644 so that containers
running as their own user (uid 10001) can read them through a bind mount — the directory keeps
them from other users of the host.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
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
                           r"redis-users\.acl\Z|etcd-[a-z]+\.password\Z|policy-signing\.(key|pub)\Z|etcd-(ca|server)\.(crt|key)\Z|"
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
             "etcd-ca.crt", "etcd-ca.key", "etcd-server.crt", "etcd-server.key", "dev-idp.key", "jwks.json"]
    return names


@dataclass(frozen=True)
class Generated:
    dir: Path
    files: list[Path]


STAGE_PREFIX = ".leasehold-secrets-"  # the staging directory a run writes into before anything is in place


def generate(out: Path, regions: tuple[str, ...] = ("eu", "us"), *, force: bool = False) -> Generated:
    """Write the credentials into ``out`` (created 0700). Refuses when any of them exists,
    unless ``force``. All or nothing: every file is written into a staging directory first (beside
    ``out`` when it does not exist, inside it when it does: one filesystem either way), and only a
    complete set is moved into place; a failure or an interruption leaves ``out`` as it was. (A run
    killed outright leaves its staging directory, ``.leasehold-secrets-*``, never a partial ``out``.)"""
    if not regions or len(set(regions)) != len(regions) or not all(REGION_RE.match(r) for r in regions):
        raise SecretsError(f"regions must be distinct names matching {human(REGION)}: {','.join(regions)!r}")
    if out.exists() and not out.is_dir():
        raise SecretsError(f"{out} is not a directory")
    names = file_names(regions)
    existing = [n for n in names if os.path.lexists(out / n)]
    if existing and not force:
        raise SecretsError(f"{out} already holds {', '.join(existing)}: refusing to replace credentials "
                           f"(--force replaces them all)")
    dirs = [n for n in existing if (out / n).is_dir() and not (out / n).is_symlink()]
    if dirs:  # --force replaces files, never a directory someone put there
        raise SecretsError(f"{out / dirs[0]} is a directory, not a credential file: move it away first")
    if out.is_dir() and out.stat().st_mode & 0o077:
        others = sorted(p.name for p in out.iterdir() if not CREDENTIAL_RE.match(p.name))
        if others:  # never narrow the mode of a directory that holds other things (a checkout, /tmp, a home)
            raise SecretsError(f"{out} is open to other users and holds other files ({', '.join(others[:3])}"
                               f"{', ...' if len(others) > 3 else ''}): the credentials need a directory of their "
                               f"own (a new one is created 0700)")
    fresh = not out.is_dir()
    if fresh:
        out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=out.parent if fresh else out))  # 0700
    try:
        _write(stage, regions)
        if fresh:
            os.rename(stage, out)  # the directory appears whole
        else:
            _move_in(stage, out, names)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # what is left: a failed run's files, the replaced ones
    return Generated(out, [out / n for n in names])


def _move_in(stage: Path, out: Path, names: list[str]) -> None:
    """Move the staged files into the existing directory ``out`` (narrowed to 0700 first). Each
    rename is atomic; should one fail, the ones done are undone and the files they replaced (kept
    in the stage meanwhile) put back, and ``out`` gets its mode back."""
    mode = stat.S_IMODE(out.stat().st_mode)
    replaced = stage / ".replaced"
    replaced.mkdir()
    placed: list[str] = []
    out.chmod(0o700)
    try:
        for name in names:
            if os.path.lexists(out / name):
                os.rename(out / name, replaced / name)
            os.rename(stage / name, out / name)
            placed.append(name)
    except BaseException:
        for name in placed:
            with contextlib.suppress(OSError):
                os.rename(out / name, stage / name)
        for old in replaced.iterdir():
            with contextlib.suppress(OSError):
                os.rename(old, out / old.name)
        with contextlib.suppress(OSError):
            out.chmod(mode)
        raise


def _write(d: Path, regions: tuple[str, ...]) -> None:
    """Every credential file of ``regions`` into the new, empty directory ``d``."""

    def put(name: str, text: str) -> None:
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        (d / name).chmod(0o644)  # whatever the umask: readable by a container's own user (see the module doc)

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
    _, pub = generate_keypair(d, "policy-signing")  # the key 0600, never mounted into a service
    pub.chmod(0o644)
    # etcd's TLS (decision 0069): a CA, and a certificate for the members; clients get the CA only
    for name, data, mode in etcd_pki():
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        (d / name).chmod(mode)
    # a stand-in identity provider for trying the stack (module doc): its key 0600, its JWKS
    idp = DevIssuer()
    idp.write_key(d / "dev-idp.key")
    put("jwks.json", json.dumps(idp.jwks(), indent=2) + "\n")


ETCD_NAMESPACE = "leasehold"  # deploy/k8s's namespace
ETCD_MEMBERS = 3  # deploy/k8s-dev's StatefulSet etcd and deploy/docker-compose.yml's etcd-0..2
CA_DAYS, SERVER_DAYS = 3650, 825  # decision 0069: renew etcd's certificate before it ends


def etcd_hostnames(namespace: str = ETCD_NAMESPACE, members: int = ETCD_MEMBERS) -> list[str]:
    """The DNS names etcd's certificate carries: each member as compose names it (``etcd-N``), as
    the StatefulSet's headless Service names it (short and qualified), and the Service itself."""
    names = []
    for i in range(members):
        pod = f"etcd-{i}"
        names += [pod, f"{pod}.etcd", f"{pod}.etcd.{namespace}", f"{pod}.etcd.{namespace}.svc",
                  f"{pod}.etcd.{namespace}.svc.cluster.local"]
    return [*names, "etcd", f"etcd.{namespace}.svc", f"etcd.{namespace}.svc.cluster.local", "localhost"]


def etcd_pki() -> list[tuple[str, bytes, int]]:
    """etcd's CA and its members' certificate (server and peer: both extended key usages, since
    a member is its peers' client), as ``(file name, PEM, mode)``; private keys 0600."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)  # clock skew
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "leasehold etcd CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in etcd_hostnames()]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "::1")]
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd")]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                           crl_sign=False, content_commitment=False, data_encipherment=False,
                                           key_agreement=False, encipher_only=False, decipher_only=False),
                             critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                    ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
              .add_extension(x509.SubjectAlternativeName(sans), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
              .sign(ca_key, hashes.SHA256()))

    def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    return [("etcd-ca.crt", ca.public_bytes(serialization.Encoding.PEM), 0o644), ("etcd-ca.key", pem_key(ca_key), 0o600),
            ("etcd-server.crt", server.public_bytes(serialization.Encoding.PEM), 0o644),
            ("etcd-server.key", pem_key(key), 0o600)]


__all__ = ["Generated", "SecretsError", "etcd_hostnames", "etcd_pki", "file_names", "generate"]
