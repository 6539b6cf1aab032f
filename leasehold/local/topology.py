"""The local multi-region topology: etcd, allocator replicas, and regions each with a Redis
and one or more region agents — all real processes on loopback, all files under one run
directory, every process stopped by PID.

Used by ``leasehold up/down/status/demo`` (``make run``), the end-to-end and chaos tests and
the benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from kernel.resources import sample_policy

from .procs import LOOPBACK, EtcdCluster, Proc, RedisServer, free_port, wait_http_ready, wait_port
from .services import agent_command, allocator_command

# the services' default etcd prefix (neither is started with another): the keys the start writes live under it
ETCD_PREFIX = "/leasehold/"

REPO = Path(__file__).resolve().parents[2]  # the source checkout when installed editable


RUN_DIR_ENV = "LEASEHOLD_RUN_DIR"


def default_run_dir() -> Path:
    """``$LEASEHOLD_RUN_DIR``, else ``.run`` of the source checkout (``make run``), else of the
    working directory (a wheel)."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    return (REPO if (REPO / "pyproject.toml").exists() else Path.cwd()) / ".run"
DEFAULT_POLICY = sample_policy("northstar-global.json")
DEV_PEPPER = "leasehold-local-dev-pepper-not-secret"


@dataclass
class TopologySpec:
    run_dir: Path
    policy: Path = DEFAULT_POLICY
    regions: tuple[str, ...] = ("eu", "us")
    agents_per_region: int = 1
    allocators: int = 2
    etcd_members: int = 1
    with_allocator: bool = True
    link_agents_to_allocator: bool = True  # agents spend leases from the allocators
    agent_args: tuple[str, ...] = ()  # extra flags for every region agent
    allocator_args: tuple[str, ...] = ()  # extra flags for every allocator replica
    auth: bool = False  # bearer tokens generated into <run_dir>/secrets (``leasehold up`` turns this on);
    #                     False passes an explicit --auth-disabled to every service
    policy_from_etcd: bool = False  # agents follow <prefix>policy/current (``leasehold policy publish``)
    signed: bool = False  # a policy-signing key pair in <run_dir>/secrets: the start bundle is signed with it,
    #                       every service trusts only its public key, and etcd carries the signing marker
    extra_public_keys: tuple[str, ...] = ()  # more trusted public keys (a key rotation in progress)
    rls: bool = False  # every agent also serves Envoy's rate limit service (--rls-port, a free port each)
    insecure_dev_pepper: bool = False  # opt in to the agents' public development pepper; by default a
    #                                    random pepper is generated into <run_dir>/secrets/pepper
    decision_logs: bool = False  # every agent writes <run_dir>/decisions-<region>-<n>.jsonl (the sampled decision log)


@dataclass
class ServiceInfo:
    name: str
    kind: str  # etcd | allocator | redis | agent
    pid: int
    url: str
    region: str | None = None
    log: str = ""


@dataclass
class LocalTopology:
    spec: TopologySpec
    etcd: EtcdCluster | None = None
    redis: dict[str, RedisServer] = field(default_factory=dict)
    allocators: list[Proc] = field(default_factory=list)
    allocator_urls: list[str] = field(default_factory=list)
    agents: dict[str, list[Proc]] = field(default_factory=dict)
    agent_urls: dict[str, list[str]] = field(default_factory=dict)
    rls_ports: dict[str, list[int]] = field(default_factory=dict)  # per region, per agent (spec.rls)
    secrets: Secrets | None = None  # the generated credentials when spec.auth
    signing: tuple[Path, Path] | None = None  # (private key, public key) when spec.signed
    policy_path: Path | None = None  # the start bundle the services load (signed copy when spec.signed)
    pepper_file: Path | None = None  # the agents' generated pepper (None with spec.insecure_dev_pepper)

    @property
    def pepper(self) -> bytes:
        """The agents' HMAC pepper (what a test needs to derive their Redis keys)."""
        if self.pepper_file is None:
            from region_agent.service.settings import DEV_PEPPER as AGENT_DEV_PEPPER
            return AGENT_DEV_PEPPER
        return self.pepper_file.read_bytes().strip()

    def gateway_headers(self) -> dict[str, str]:
        """What a gateway sends to the agents (empty with auth off)."""
        return {"Authorization": f"Bearer {self.secrets.gateway}"} if self.secrets else {}

    def operator_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets.operator}"} if self.secrets else {}

    # ------------------------------------------------------------------ start/stop
    def start(self, timeout: float = 60.0) -> LocalTopology:
        run = self.spec.run_dir
        run.mkdir(parents=True, exist_ok=True)
        if self.spec.auth:
            self.secrets = Secrets.generate(run / "secrets", self.spec.regions)
        if not self.spec.insecure_dev_pepper:
            import secrets as _secrets
            self.pepper_file = write_secret(run / "secrets", "pepper", _secrets.token_urlsafe(32))
        self.policy_path = self.spec.policy
        trust: list[str] = []
        if self.spec.signed:
            self.signing, self.policy_path = sign_start_bundle(run, self.spec.policy)
            trust = ["--policy-public-keys", ",".join([str(self.signing[1]), *self.spec.extra_public_keys])]
        try:
            if self.spec.with_allocator:
                # a fresh cluster every run: a previous run's data dir has its (now unknown) users and
                # auth enabled, and its pools/grants belong to that run
                shutil.rmtree(run / "etcd", ignore_errors=True)
                self.etcd = EtcdCluster(run / "etcd", members=self.spec.etcd_members).start(timeout)
                from kernel.policy_store import policy_key, published_version_key, signing_key
                if self.signing:  # before auth is on: ``policy publish`` refuses unsigned bundles
                    self.etcd.etcdctl("put", signing_key(ETCD_PREFIX).decode(), stdin=signing_marker(self.signing[1]))
                if self.spec.policy_from_etcd:
                    # the start bundle is the published one: what the services follow is what they run,
                    # so `policy show`, `validate --against-etcd` and a canary (staged over a published
                    # bundle) see it instead of nothing
                    self.etcd.etcdctl("put", policy_key(ETCD_PREFIX).decode(), stdin=Path(self.policy_path).read_text())
                    # and its version, as every publish writes it (a publish must be above it: kernel.policy_store)
                    from kernel.bundle import load_bundle_file
                    from kernel.policy_store import published_version_value
                    self.etcd.etcdctl("put", published_version_key(ETCD_PREFIX).decode(), stdin=published_version_value(
                        load_bundle_file(self.policy_path).bundle_version).decode())
                if self.secrets:
                    self.secrets.enable_etcd_auth(self.etcd)
                for i in range(self.spec.allocators):
                    port = free_port()
                    url = f"http://{LOOPBACK}:{port}"
                    proc = Proc(f"allocator-{i + 1}", allocator_command(
                        *trust, *(self.secrets.allocator_args() if self.secrets else ("--auth-disabled",)),
                        *self.spec.allocator_args, etcd=self.etcd.endpoints, policy=self.policy_path,
                        node_id=f"alloc-{i + 1}", host=LOOPBACK, port=port, advertise_url=url,
                    ), run / f"allocator-{i + 1}", env=_env()).start()
                    self.allocators.append(proc)
                    self.allocator_urls.append(url)
                for proc, url in zip(self.allocators, self.allocator_urls, strict=True):
                    wait_port(int(url.rsplit(":", 1)[1]), proc=proc, timeout=timeout)  # its log's tail if it exits
                # the allocators know their roles before the agents' first leases are asked for
                # (an agent whose warm-up met no leader would start with empty balances)
                if self.spec.link_agents_to_allocator:
                    wait_http_ready(dict(zip(self.allocator_urls, self.allocators, strict=True)), timeout)
            for region in self.spec.regions:
                self.redis[region] = RedisServer(run / f"redis-{region}", **(
                    self.secrets.redis_acl() if self.secrets else {})).start(timeout)
                self.agents[region] = []
                self.agent_urls[region] = []
                self.rls_ports[region] = []
                for j in range(self.spec.agents_per_region):
                    port = free_port()
                    redis_url = (f"redis://agent@{LOOPBACK}:{self.redis[region].port}/0" if self.secrets
                                 else self.redis[region].url)  # ACL user; its password from a file
                    args = agent_command(*trust, redis_url=redis_url, policy=self.policy_path, region=region,
                                         host=LOOPBACK, port=port)
                    if self.allocator_urls and self.spec.link_agents_to_allocator:
                        args += ["--allocator-urls", ",".join(self.allocator_urls)]
                    args += self.secrets.agent_args(region) if self.secrets else ["--auth-disabled"]
                    if self.spec.policy_from_etcd and self.etcd is not None:
                        args += ["--policy-etcd", ",".join(self.etcd.endpoints)]
                        if self.secrets:
                            args += self.secrets.agent_etcd_args()
                    args += ["--audit-log", str(run / f"audit-{region}-{j + 1}.jsonl")]  # privileged bypasses
                    args += ["--agent-id", f"agent-{region}-{j + 1}"]  # what a canary slice names
                    if self.spec.decision_logs:
                        args += ["--decision-log", str(run / f"decisions-{region}-{j + 1}.jsonl")]
                    if self.spec.rls:
                        rls_port = free_port()
                        args += ["--rls-port", str(rls_port)]
                        self.rls_ports[region].append(rls_port)
                    args += (["--pepper-file", str(self.pepper_file)] if self.pepper_file is not None
                             else ["--insecure-dev-pepper"])  # the public pepper only when asked for
                    args += list(self.spec.agent_args)
                    env = {k: v for k, v in _env().items() if k != "LEASEHOLD_AGENT_PEPPER"}
                    proc = Proc(f"agent-{region}-{j + 1}", args, run / f"agent-{region}-{j + 1}", env=env).start()
                    self.agents[region].append(proc)
                    self.agent_urls[region].append(f"http://{LOOPBACK}:{port}")
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.write_state()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        pending = dict(zip(self.allocator_urls, self.allocators, strict=True))
        for region, urls in self.agent_urls.items():
            pending.update(zip(urls, self.agents[region], strict=True))
        wait_http_ready(pending, timeout)

    def stop(self) -> None:
        for procs in self.agents.values():
            for p in procs:
                p.stop()
        for p in self.allocators:
            p.stop()
        for r in self.redis.values():
            r.stop()
        if self.etcd:
            self.etcd.stop()
        state = self.spec.run_dir / "topology.json"
        if state.exists():
            state.unlink()

    # ------------------------------------------------------------------ state file
    def services(self) -> list[ServiceInfo]:
        out: list[ServiceInfo] = []
        if self.etcd:
            for i, p in enumerate(self.etcd.procs):
                out.append(ServiceInfo(p.name, "etcd", p.pid, f"http://{self.etcd.endpoints[i]}", log=str(p.log_path)))
        for p, url in zip(self.allocators, self.allocator_urls, strict=True):
            out.append(ServiceInfo(p.name, "allocator", p.pid, url, log=str(p.log_path)))
        for region, r in self.redis.items():
            assert r.proc is not None
            out.append(ServiceInfo(r.proc.name, "redis", r.proc.pid, r.public_url, region=region,
                                   log=str(r.proc.log_path)))
        for region, procs in self.agents.items():
            for p, url in zip(procs, self.agent_urls[region], strict=True):
                out.append(ServiceInfo(p.name, "agent", p.pid, url, region=region, log=str(p.log_path)))
        return out

    def write_state(self) -> None:
        path = self.spec.run_dir / "topology.json"
        tmp = path.with_name(path.name + ".tmp")  # written whole, then renamed: never read half-written
        tmp.write_text(json.dumps({"started": time.time(), "bootId": boot_id(), "policy": str(self.spec.policy),
                                    "secrets": str(self.secrets.dir) if self.secrets else None,
                                    "signingKey": str(self.signing[0]) if self.signing else None,
                                    "services": [asdict(s) for s in self.services()]}, indent=2))
        tmp.replace(path)


@dataclass
class Secrets:
    """Throwaway credentials for one local run, in ``<run_dir>/secrets`` (0700, files 0600).
    Services get file paths and sha256 digests on their command lines, never a token."""

    dir: Path
    gateway: str
    operator: str
    regions: dict[str, str]

    @classmethod
    def generate(cls, d: Path, regions: tuple[str, ...]) -> Secrets:
        import secrets as _secrets

        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        s = cls(d, _secrets.token_urlsafe(32), _secrets.token_urlsafe(32),
                {r: _secrets.token_urlsafe(32) for r in regions})
        s._write("gateway.token", s.gateway)
        s._write("operator.token", s.operator)
        for r, tok in s.regions.items():
            s._write(f"region-{r}.token", tok)
        s._write("allocator-region-tokens", "".join(f"{r}:{_sha(t)}\n" for r, t in s.regions.items()))
        s._write("agent-gateway-tokens", f"gateway:{_sha(s.gateway)}\n")
        s._write("agent-operator-tokens", f"operator:{_sha(s.operator)}\n")
        return s

    def _write(self, name: str, text: str) -> None:
        write_secret(self.dir, name, text)

    def allocator_args(self) -> list[str]:
        return ["--no-auth-disabled", "--region-tokens-file", str(self.dir / "allocator-region-tokens"),
                "--etcd-user", "allocator", "--etcd-password-file", str(self.dir / "etcd-allocator.password")]

    def publisher_args(self) -> list[str]:
        """What ``leasehold policy publish`` uses: the publisher (write on the policy key only)."""
        return ["--etcd-user", "publisher", "--etcd-password-file", str(self.dir / "etcd-publisher.password")]

    def password(self, name: str) -> str:
        path = self.dir / f"{name}.password"
        if not path.exists():
            import secrets as _secrets
            self._write(path.name, _secrets.token_urlsafe(24))
        return path.read_text()

    def redis_acl(self) -> dict:
        """Redis with ACLs on: the default user password-protected, the agent limited to rl:* scripts."""
        from .procs import agent_acl
        return {"admin_password": self.password("redis-admin"),
                "users": [agent_acl("agent", self.password("redis-agent"))]}

    def enable_etcd_auth(self, etcd: EtcdCluster) -> None:
        """etcd authentication with Leasehold's roles (deploy/etcd/leasehold-roles.sh): a publisher
        that may write the policy key only, the allocator on pools/grants/leader (policy read-only),
        agents read-only on the policy key, and root."""
        from .procs import ETCD_USERS
        for user in ETCD_USERS:
            self.password(f"etcd-{user}")
        etcd.apply_roles({u: self.dir / f"etcd-{u}.password" for u in ETCD_USERS})

    def agent_etcd_args(self) -> list[str]:
        return ["--policy-etcd-user", "agent", "--policy-etcd-password-file", str(self.dir / "etcd-agent.password")]

    def agent_args(self, region: str) -> list[str]:
        return ["--no-auth-disabled", "--allocator-token-file", str(self.dir / f"region-{region}.token"),
                "--redis-password-file", str(self.dir / "redis-agent.password"),
                "--gateway-tokens-file", str(self.dir / "agent-gateway-tokens"),
                "--operator-tokens-file", str(self.dir / "agent-operator-tokens")]


def write_secret(d: Path, name: str, text: str) -> Path:
    """A secret file ``d/name`` (directory 0700, file 0600), replaced if it exists."""
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    path = d / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def sign_start_bundle(run: Path, policy: Path) -> tuple[tuple[Path, Path], Path]:
    """A fresh Ed25519 key pair in ``<run>/secrets`` (0700; the private key 0600) and the start
    bundle signed with it at ``<run>/policy.signed.json``."""
    from kernel.bundle import encode_bundle, load_bundle_file
    from kernel.signing import generate_keypair, load_private_key, sign_bundle

    d = run / "secrets"
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    key, pub = generate_keypair(d, "policy-signing", replace=True)  # this run's own key, made at every start
    signed = run / "policy.signed.json"
    signed.write_bytes(encode_bundle(sign_bundle(load_bundle_file(str(policy)), load_private_key(key))) + b"\n")
    return (key, pub), signed


def signing_marker(pub: Path) -> str:
    """The etcd signing marker (kernel.policy_store.SigningMarker) trusting ``pub``."""
    import msgspec

    from kernel.policy_store import SigningMarker
    from kernel.signing import key_id_of, load_public_key, public_key_text

    k = load_public_key(pub)
    return msgspec.json.encode(SigningMarker(keys={key_id_of(k): public_key_text(k)})).decode()


def _sha(token: str) -> str:
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


def read_token(state: dict, name: str) -> str | None:
    """A token of the running topology (``gateway`` or ``operator``), from its secrets dir; None
    when it runs without authentication (``up --no-auth``). A token file that is gone, unreadable
    or empty is a :class:`TokenFileError` naming it: sent without a token, every call would be
    refused as unauthenticated."""
    d = state.get("secrets")
    if not d:
        return None
    path = Path(d) / f"{name}.token"
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"cannot read the local topology's {name} token {path}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise TokenFileError(f"the local topology's {name} token {path} is empty")
    return token


class TokenFileError(ValueError):
    """A token file of the running local topology cannot be used (gone, unreadable, empty)."""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


class StateError(ValueError):
    """``topology.json`` is there but is not a state file this module wrote (edited, truncated)."""


class _ServiceState(msgspec.Struct):
    """What every reader of a service's entry uses (``write_state`` writes :class:`ServiceInfo`)."""

    name: str
    kind: str
    pid: Annotated[int, msgspec.Meta(gt=1)]  # never 0, -1 or 1: os.kill would signal a group or init
    url: str


class _State(msgspec.Struct):
    services: list[_ServiceState]


def read_state(run_dir: Path) -> dict | None:
    """The running topology's state (``None`` without one); :class:`StateError` for a file of
    another shape, checked here once so that no reader fails on a field later."""
    path = run_dir / "topology.json"
    if not path.exists():
        return None
    try:
        raw = path.read_bytes()
        msgspec.json.decode(raw, type=_State)
        state: dict = json.loads(raw)
    except (OSError, ValueError, msgspec.DecodeError) as e:
        raise StateError(f"{path} is not a topology state file ({e})") from None
    return state


def boot_id() -> str | None:
    """This boot of the machine (Linux), or None: a state file of another boot names processes
    that died with it, whose pids may now be anyone's."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def same_boot(state: dict) -> bool:
    """The state file was written since this machine started (a file without a boot id: assumed)."""
    recorded, now = state.get("bootId"), boot_id()
    return recorded is None or now is None or recorded == now


def stop_from_state(run_dir: Path, timeout: float = 5.0) -> list[str]:
    """Stop every process recorded in the run directory's state file (``leasehold down``). A file
    of an earlier boot signals nothing (its processes died with that boot; the pids are others')."""
    state = read_state(run_dir)
    if state is None:
        return []
    stopped: list[str] = []
    for svc in reversed(state["services"] if same_boot(state) else []):
        pid = svc["pid"]
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        stopped.append(svc["name"])
    (run_dir / "topology.json").unlink(missing_ok=True)
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reap if it is our child
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True
