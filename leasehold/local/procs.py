"""Start and stop real server processes (redis-server, a Redis Cluster, etcd members) on free
loopback ports, each in its own directory, stopped by PID. Used by test fixtures, the local
topology, chaos and benchmarks — one implementation of "a real server on a free port"."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
_PORT_FLOOR = 10_000  # free_port chooses between this and the ephemeral range
_used_ports: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their local ports
    from it, so a port chosen there can be taken by any connection before our server binds it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(avoid_bus: bool = False) -> int:
    """A free loopback TCP port, chosen at random below the ephemeral range: the time between
    this check and the server's bind is a race with every other process on the machine, and
    outgoing connections (of this run and of others beside it) only use the ephemeral range.
    With ``avoid_bus`` the port + 10000 is free too (Redis Cluster's bus port)."""
    high = _ephemeral_low() - (10_000 if avoid_bus else 0)
    rng = random.SystemRandom()
    for _ in range(200 if high > _PORT_FLOOR + 1_000 else 0):
        port = rng.randrange(_PORT_FLOOR, high)
        if port in _used_ports or not _port_free(port) or (avoid_bus and not _port_free(port + 10_000)):
            continue
        return _take(port, avoid_bus)
    for _ in range(200):  # no room below the ephemeral range: let the kernel choose
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port in _used_ports or (avoid_bus and (port + 10000 > 65535 or not _port_free(port + 10000))):
            continue
        return _take(port, avoid_bus)
    raise RuntimeError("no free port found")


def _take(port: int, avoid_bus: bool) -> int:
    _used_ports.add(port)
    if avoid_bus:
        _used_ports.add(port + 10_000)
    return port


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def wait_port(port: int, host: str = LOOPBACK, timeout: float = 15.0, proc: Proc | subprocess.Popen | None = None) -> None:
    """Until something listens on ``host:port``. ``proc``: the process that should; if it exits
    first, the error says with which code and — for a :class:`Proc` — ends with the tail of its
    log (its stdout and stderr), so a failed start explains itself."""
    popen = proc.popen if isinstance(proc, Proc) else proc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            tail = proc.tail(20) if isinstance(proc, Proc) else ""
            raise RuntimeError(f"process {popen.args!r} exited with {popen.returncode} before listening on {port}"
                               + (f"; the end of its log ({proc.log_path}):\n{tail}" if tail else ""))
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


START_PATHS = ("/readyz", "/v1/health/store")


def wait_http_ready(pending: dict[str, Proc], timeout: float = 60.0, paths: Sequence[str] = START_PATHS) -> None:
    """Wait until every service (base URL -> its process) answers 200 on each of ``paths`` —
    by default ready (it can answer) and its store healthy (Redis, or etcd with its role known):
    what a start-up supervisor wants before traffic; a process that exits meanwhile fails at once
    with the tail of its log."""
    import httpx

    pending = dict(pending)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while pending and time.monotonic() < deadline:
            for url, proc in list(pending.items()):
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.tail()}")
                try:
                    if all(client.get(url + path).status_code == 200 for path in paths):
                        del pending[url]
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
    if pending:
        raise TimeoutError(f"not ready after {timeout}s: {', '.join(p.name for p in pending.values())}")


@dataclass
class Proc:
    """A child process we own, with its log file; ``stop`` ends it by PID."""

    name: str
    args: list[str]
    workdir: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen | None = None
    log_path: Path | None = None
    cwd: str | Path | None = None  # the working directory (default: ``workdir``, which holds the log)

    def start(self) -> Proc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(self.args, cwd=self.cwd or self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)  # a SIGSTOPped child cannot handle SIGTERM
                os.kill(self.pid, signal.SIGTERM)
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout)
            except ProcessLookupError:
                pass
        self.popen = None

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(5)  # type: ignore[union-attr]  # alive() is true only with a Popen
        self.popen = None

    def tail(self, n: int = 40) -> str:
        if self.log_path and self.log_path.exists():
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


# --------------------------------------------------------------------------------------------
@dataclass
class RedisServer:
    workdir: Path
    port: int = 0
    extra_args: Sequence[str] = ()
    proc: Proc | None = None
    admin_password: str | None = None  # ACLs on: the default user needs this password
    users: Sequence[str] = ()  # ACL rules, one user each (see ``agent_acl``)
    tls: TlsFiles | None = None  # serve TLS only (the plain port is closed)
    env: dict[str, str] | None = None  # the server's environment (e.g. libfaketime's), kept across restarts

    @property
    def url(self) -> str:
        """The admin URL (default user, password included when ACLs are on)."""
        auth = f"default:{self.admin_password}@" if self.admin_password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}{LOOPBACK}:{self.port}/0"

    @property
    def public_url(self) -> str:
        """The URL without credentials (for status output and state files)."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{LOOPBACK}:{self.port}/0"

    def _acl_args(self) -> list[str]:
        """ACL users go in a 0600 ACL file (passwords never on the command line)."""
        args: list[str] = []
        if self.admin_password or self.users:
            self.workdir.mkdir(parents=True, exist_ok=True)
            lines = [f"user default on >{self.admin_password} ~* &* +@all" if self.admin_password else
                     "user default on nopass ~* &* +@all", *(f"user {rule}" for rule in self.users)]
            acl = self.workdir / "users.acl"
            fd = os.open(acl, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(lines) + "\n")
            args += ["--aclfile", str(acl)]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        return args

    def start(self, timeout: float = 15.0) -> RedisServer:
        if not self.port:
            self.port = free_port()
        args = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", LOOPBACK,
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir),
                "--maxmemory-policy", "noeviction", "--protected-mode", "no", *self._acl_args(), *self.extra_args]
        self.proc = Proc(f"redis-{self.port}", args, self.workdir, env=self.env).start()
        wait_port(self.port, proc=self.proc, timeout=timeout)
        return self

    def restart(self) -> None:
        """Stop and start on the same port: the script cache and (no persistence) all state are lost."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()

    def cli(self, *cmd: str) -> str:
        auth = ["--user", "default", "--pass", self.admin_password, "--no-auth-warning"] if self.admin_password else []
        tls = ["--tls", "--cacert", str(self.tls.ca)] if self.tls else []
        return subprocess.run(["redis-cli", "-p", str(self.port), *auth, *tls, *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()


# Commands the region agent really sends (scripts, readiness, store health; for Redis Cluster its
# slot-map read and the ASKING before a call sent to a slot's migration target) and the commands its
# Lua scripts call — scripts run under the caller's ACL user. Keys: ``rl:*`` only.
AGENT_COMMANDS = ("evalsha", "eval", "script|load", "script|exists", "ping", "info", "time", "cluster|slots", "asking",
                  "get", "set", "hget", "hmget", "hset", "hdel", "hexists", "hgetall", "hlen", "pexpire", "pttl",
                  "zadd", "zcount", "zrange", "zrangebyscore", "zrem", "zremrangebyscore", "zscore")


def agent_acl(user: str, password: str) -> str:
    """An ACL rule for the agent: its commands on ``rl:*`` keys, nothing else (no FLUSHALL,
    CONFIG, KEYS, no pub/sub channels)."""
    return " ".join([user, "on", f">{password}", "resetkeys", "~rl:*", "resetchannels", "-@all",
                     *(f"+{c}" for c in AGENT_COMMANDS)])


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, one server certificate for 127.0.0.1/localhost and one client certificate
    (``make_tls``)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path | None = None  # extendedKeyUsage clientAuth, CN leasehold-client
    client_key: Path | None = None


def make_tls(d: Path) -> TlsFiles:
    """Generate a CA and a server certificate with ``openssl`` (tests and local runs only)."""
    d.mkdir(parents=True, exist_ok=True)

    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=leasehold-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=leasehold-client", "-keyout", "client.key",
        "-out", "client.csr")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "client.ext", "-out", "client.crt")
    return TlsFiles(ca=d / "ca.crt", cert=d / "server.crt", key=d / "server.key", client_cert=d / "client.crt",
                    client_key=d / "client.key")


ETCD_USERS = ("root", "publisher", "allocator", "agent")  # leasehold/local/etcd_roles.sh (deploy/etcd/leasehold-roles.sh)


def etcd_roles_script() -> Path:
    """The one definition of Leasehold's etcd roles (shipped in the package, used by the deploy
    manifests too)."""
    from importlib import resources

    return Path(str(resources.files("leasehold.local").joinpath("etcd_roles.sh")))


@dataclass
class RedisCluster:
    """A real Redis Cluster of ``masters`` primaries created with ``redis-cli --cluster create``
    (slots split evenly in node order), and one replica for each primary index in ``replicas_of``.
    ``full_coverage=False`` runs the nodes with ``cluster-require-full-coverage no``: the healthy
    primaries keep serving their slots while another primary is down (what the agent's per-shard
    breakers rely on; see region_agent/README.md)."""

    workdir: Path
    masters: int = 3
    nodes: list[RedisServer] = field(default_factory=list)  # the primaries, in slot order at creation
    replicas_of: Sequence[int] = ()
    replicas: list[RedisServer] = field(default_factory=list)
    node_timeout_ms: int = 2000
    full_coverage: bool = True

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _node(self, name: str) -> RedisServer:
        port = free_port(avoid_bus=True)
        node = RedisServer(self.workdir / name, port=port,
                           extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                       "--cluster-node-timeout", str(self.node_timeout_ms),
                                       "--cluster-require-full-coverage", "yes" if self.full_coverage else "no"))
        node.workdir.mkdir(parents=True, exist_ok=True)
        return node.start()

    def start(self, timeout: float = 30.0) -> RedisCluster:
        try:
            for i in range(self.masters):
                self.nodes.append(self._node(f"node{i}"))
            subprocess.run(["redis-cli", "--cluster", "create", *[f"{LOOPBACK}:{n.port}" for n in self.nodes],
                            "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True,
                           timeout=timeout, check=True)
            self.wait_ok(timeout)
            for i in self.replicas_of:
                self.add_replica(i, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0, nodes: Sequence[RedisServer] | None = None) -> None:
        """Until every node (of ``nodes``) reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in (nodes or self.nodes + self.replicas)):
                return
            time.sleep(0.1)
        raise TimeoutError("redis cluster did not reach cluster_state:ok")

    def node_id(self, node: RedisServer) -> str:
        return node.cli("cluster", "myid")

    def add_replica(self, i: int, timeout: float = 30.0) -> RedisServer:
        """Start a node and make it a replica of primary ``i``; returns once it is in sync."""
        primary = self.nodes[i]
        replica = self._node(f"replica{len(self.replicas)}")
        self.replicas.append(replica)
        subprocess.run(["redis-cli", "--cluster", "add-node", f"{LOOPBACK}:{replica.port}",
                        f"{LOOPBACK}:{primary.port}", "--cluster-slave", "--cluster-master-id",
                        self.node_id(primary)], capture_output=True, text=True, timeout=timeout, check=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = replica.cli("info", "replication")
            if "master_link_status:up" in info and "role:slave" in info:
                self.wait_ok(timeout)
                return replica
            time.sleep(0.1)
        raise TimeoutError("the replica did not sync with its primary")

    def owner(self, slot: int) -> RedisServer:
        """The node serving ``slot`` now (asked of a live node)."""
        for n in self.nodes + self.replicas:
            if not n.proc or not n.proc.alive():
                continue
            try:
                out = n.cli("cluster", "shards")
            except subprocess.SubprocessError:
                continue
            port = _slot_owner_port(out, slot)
            if port is not None:
                return next(x for x in self.nodes + self.replicas if x.port == port)
        raise LookupError(f"no live node names the owner of slot {slot}")

    def stop(self) -> None:
        for n in self.nodes + self.replicas:
            n.stop()


def _slot_owner_port(cluster_shards: str, slot: int) -> int | None:
    """The port of the live primary of the shard whose slot ranges hold ``slot``, from the text
    ``redis-cli cluster shards`` prints (one value per line)."""
    lines = cluster_shards.splitlines()
    i = 0
    while i < len(lines):
        if lines[i] == "slots":
            ranges, j = [], i + 1
            while j < len(lines) and lines[j].isdigit():
                ranges.append(int(lines[j]))
                j += 1
            covers = any(a <= slot <= b for a, b in zip(ranges[0::2], ranges[1::2], strict=False))
            k = j
            port = role = health = None
            while k < len(lines) and lines[k] != "slots":
                if lines[k] == "port":
                    port = int(lines[k + 1])
                elif lines[k] == "role":
                    role = lines[k + 1]
                elif lines[k] == "health":
                    health = lines[k + 1]
                    if covers and role == "master" and health == "online" and port is not None:
                        return port
                k += 1
            i = k
        else:
            i += 1
    return None


@dataclass
class RedisSentinels:
    """A real Redis primary, ``replicas`` replicas of it and ``sentinels`` ``redis-sentinel``
    processes monitoring it as ``service`` (quorum ``quorum``), on free loopback ports. ``url`` is
    the agent's ``redis+sentinel://`` URL for them."""

    workdir: Path
    service: str = "leasehold"
    replicas: int = 1
    sentinels: int = 3
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 10_000
    servers: list[RedisServer] = field(default_factory=list)  # the first primary, then its replicas
    sentinel_ports: list[int] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"{LOOPBACK}:{p}" for p in self.sentinel_ports) + f"/{self.service}"

    def start(self, timeout: float = 30.0) -> RedisSentinels:
        try:
            primary = RedisServer(self.workdir / "redis0").start(timeout)
            self.servers.append(primary)
            for i in range(self.replicas):
                self.servers.append(RedisServer(self.workdir / f"redis{i + 1}", extra_args=(
                    "--replicaof", LOOPBACK, str(primary.port))).start(timeout))
            self._wait(lambda: primary.cli("info", "replication").count(",state=online,") == self.replicas, timeout,
                       "the replicas did not sync")
            for i in range(self.sentinels):
                port = free_port()
                d = self.workdir / f"sentinel{i}"
                d.mkdir(parents=True, exist_ok=True)
                conf = d / "sentinel.conf"  # rewritten by the sentinel as it learns the topology
                conf.write_text("\n".join([
                    f"port {port}", f"bind {LOOPBACK}", "protected-mode no", f"dir {d}",
                    f"sentinel monitor {self.service} {LOOPBACK} {primary.port} {self.quorum}",
                    f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {self.service} 1", ""]))
                proc = Proc(f"sentinel-{port}", [shutil.which("redis-sentinel") or "redis-sentinel", str(conf)], d).start()
                self.procs.append(proc)
                self.sentinel_ports.append(port)
                wait_port(port, proc=proc.popen, timeout=timeout)
            want = f"num-other-sentinels\n{self.sentinels - 1}"
            self._wait(lambda: all(want in self.sentinel_cli(i, "sentinel", "master", self.service)
                                   for i in range(self.sentinels)), timeout, "the sentinels did not find each other")
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _wait(ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():
                    return
            except subprocess.SubprocessError:
                pass
            time.sleep(0.1)
        raise TimeoutError(what)

    def sentinel_cli(self, i: int, *cmd: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(self.sentinel_ports[i]), *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    def primary_port(self) -> int:
        """The primary's port as the first sentinel that answers names it."""
        for i in range(len(self.sentinel_ports)):
            try:
                return int(self.sentinel_cli(i, "sentinel", "get-master-addr-by-name", self.service).splitlines()[1])
            except (subprocess.SubprocessError, IndexError, ValueError):
                continue
        raise LookupError("no sentinel names a primary")

    def server(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        for s in self.servers:
            s.stop()


ETCD_MAX_TXN_OPS = 1024  # what our own etcd runs with (local topology, chaos, bench): see allocator/README.md


@dataclass
class EtcdCluster:
    """A real etcd cluster of ``members`` processes on loopback ports."""

    workdir: Path
    members: int = 3
    client_ports: list[int] = field(default_factory=list)
    peer_ports: list[int] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    extra_args: Sequence[str] = ()
    tls: TlsFiles | None = None  # serve clients over TLS (https client URLs) with this certificate
    client_cert_auth: bool = False  # with tls: clients must present a certificate signed by tls.ca
    # etcd's --max-txn-ops (its default is 128): the allocator discovers it and carries up to
    # (max - shards) / 2 grants per transaction; None starts etcd with its default
    max_txn_ops: int | None = ETCD_MAX_TXN_OPS

    @property
    def endpoints(self) -> list[str]:
        return [f"{LOOPBACK}:{p}" for p in self.client_ports]

    @property
    def urls(self) -> list[str]:
        """The client URLs with their scheme (``https://`` when serving TLS)."""
        return [f"{self._client_scheme}://{e}" for e in self.endpoints]

    @property
    def _client_scheme(self) -> str:
        return "https" if self.tls else "http"

    def _etcdctl_tls(self) -> list[str]:
        if not self.tls:
            return []
        client = (["--cert", str(self.tls.client_cert), "--key", str(self.tls.client_key)]
                  if self.client_cert_auth else [])
        return ["--cacert", str(self.tls.ca), *client]

    def member_name(self, i: int) -> str:
        return f"m{i}"

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        if not self.client_ports:
            self.client_ports = [free_port() for _ in range(self.members)]
            self.peer_ports = [free_port() for _ in range(self.members)]
        initial = ",".join(f"{self.member_name(i)}=http://{LOOPBACK}:{p}" for i, p in enumerate(self.peer_ports))
        for i in range(self.members):
            self.procs.append(Proc(f"etcd-{self.member_name(i)}", self._args(i, initial), self.workdir / self.member_name(i)))
        try:
            for p in self.procs:
                p.start()
            for i, port in enumerate(self.client_ports):
                wait_port(port, proc=self.procs[i], timeout=timeout)
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()  # a cluster that failed to start leaves no member running
            raise
        return self

    def _args(self, i: int, initial: str) -> list[str]:
        c, p = self.client_ports[i], self.peer_ports[i]
        return [shutil.which("etcd") or "etcd", "--name", self.member_name(i),
                "--data-dir", str(self.workdir / self.member_name(i) / "data"),
                "--listen-client-urls", f"{self._client_scheme}://{LOOPBACK}:{c}",
                "--advertise-client-urls", f"{self._client_scheme}://{LOOPBACK}:{c}",
                *(["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)] if self.tls else []),
                *(["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
                  if self.tls and self.client_cert_auth else []),
                "--listen-peer-urls", f"http://{LOOPBACK}:{p}", "--initial-advertise-peer-urls", f"http://{LOOPBACK}:{p}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"leasehold-{self.client_ports[0]}",
                "--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap",
                "--log-level", "warn",
                *([f"--max-txn-ops={self.max_txn_ops}"] if self.max_txn_ops else []), *self.extra_args]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            r = subprocess.run(["etcdctl", "--endpoints", ",".join(self.endpoints), *self._etcdctl_tls(),
                                "endpoint", "health"],
                               capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=10)
            last = r.stdout + r.stderr
            alive = [p for p in self.procs if p.alive()]
            if r.returncode == 0 or (alive and last.count("is healthy") >= len(alive) and len(alive) > self.members // 2):
                return
            time.sleep(0.2)
        raise TimeoutError(f"etcd cluster not healthy: {last}")

    def etcdctl(self, *args: str, user: str | None = None, stdin: str | None = None) -> str:
        auth = ["--user", user] if user else []
        r = subprocess.run(["etcdctl", "--endpoints", ",".join(self.endpoints), *self._etcdctl_tls(), *auth, *args],
                           input=stdin,
                           capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=15)
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {args[:2]} failed: {r.stderr.strip()[:200]}")
        return r.stdout

    def apply_roles(self, password_files: dict[str, Path], prefix: str = "/leasehold/") -> None:
        """Leasehold's users and roles, then authentication on, by running the deploy script
        (:func:`etcd_roles_script`) with one password file per user of :data:`ETCD_USERS`."""
        env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": ",".join(self.endpoints), "LEASEHOLD_PREFIX": prefix,
               **{f"{u.upper()}_PASSWORD_FILE": str(password_files[u]) for u in ETCD_USERS}}
        env.pop("ETCDCTL_USER", None)
        if self.tls:
            env["ETCDCTL_CACERT"] = str(self.tls.ca)
            if self.client_cert_auth:
                env["ETCDCTL_CERT"], env["ETCDCTL_KEY"] = str(self.tls.client_cert), str(self.tls.client_key)
        r = subprocess.run(["sh", str(etcd_roles_script())], env=env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"etcd roles script failed: {(r.stderr or r.stdout).strip()[-300:]}")

    def stop_member(self, i: int) -> None:
        self.procs[i].stop()

    def start_member(self, i: int) -> None:
        self.procs[i].start()
        wait_port(self.client_ports[i], proc=self.procs[i])

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
