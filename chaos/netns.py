"""Kernel-level partitions: network namespaces joined by veth with iptables DROP rules, and
cgroup-scoped iptables isolation of a process on loopback (an etcd member). Needs root (CI
runs as root). Only names this module creates are touched: namespaces ``lhc<pid>x<n>a/b``,
cgroups ``lhchaos-<pid>-<n>``, and iptables rules carrying the comment ``lhchaos-<pid>-<n>``;
everything is deleted on ``close``/``remove``, also when a test fails.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel.errors import BadRequest

_counter = itertools.count(1)
CMD_TIMEOUT = 10.0


class NetError(RuntimeError):
    pass


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and r.returncode != 0:
        raise NetError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


CAP_NET_ADMIN = 12
NEEDS = ("needs root or CAP_NET_ADMIN (network namespaces, veth, iptables, cgroups): run `make test` "
         "as root or with sudo, or grant the capability")


def has_net_admin(status: str | None = None) -> bool:
    """Whether this process holds CAP_NET_ADMIN (root normally does), from ``/proc/self/status``."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return os.geteuid() == 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return os.geteuid() == 0


def require_net_admin() -> None:
    """Refuse with a message that says what is missing, instead of an obscure `ip` failure."""
    if not has_net_admin():
        raise NetError(NEEDS)


def _tag() -> str:
    return f"lhchaos-{os.getpid()}-{next(_counter)}"


# ----------------------------------------------------------------------------- namespaces
@dataclass
class NetnsPair:
    """Two namespaces ``a`` and ``b`` joined by a veth pair: ``a_ip`` <-> ``b_ip`` (a /30).

    ``cut(direction)`` adds DROP rules (``a->b``, ``b->a`` or ``both``) inside the namespaces;
    ``heal()`` removes them. Use as a context manager so the namespaces always go away."""

    a: str = ""
    b: str = ""
    a_ip: str = ""
    b_ip: str = ""
    tag: str = field(default_factory=_tag)
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = next(_counter) % 250 + 1
        short = f"lhc{os.getpid() % 100000}x{n}"
        self.a, self.b = self.a or f"{short}a", self.b or f"{short}b"
        third = (os.getpid() + n) % 250 + 1
        self.a_ip, self.b_ip = self.a_ip or f"10.213.{third}.1", self.b_ip or f"10.213.{third}.2"

    def create(self) -> NetnsPair:
        require_net_admin()
        try:
            for ns in (self.a, self.b):
                run("ip", "netns", "add", ns)
                self._created.append(ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            va, vb = f"{self.a}v"[-15:], f"{self.b}v"[-15:]
            run("ip", "link", "add", va, "netns", self.a, "type", "veth", "peer", "name", vb, "netns", self.b)
            for ns, dev, ip in ((self.a, va, self.a_ip), (self.b, vb, self.b_ip)):
                run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_prefix(self, ns: str) -> list[str]:
        """argv prefix to run a command inside namespace ``ns`` (``pair.a`` or ``pair.b``)."""
        if ns not in (self.a, self.b):
            raise BadRequest(f"{ns!r} is not one of this pair's namespaces")
        return ["ip", "netns", "exec", ns]

    def cut(self, direction: str = "both") -> None:
        """Drop packets: ``a->b`` (dropped on b's INPUT), ``b->a`` (on a's INPUT), or ``both``."""
        if direction not in ("a->b", "b->a", "both"):
            raise BadRequest(f"direction must be a->b, b->a or both, got {direction!r}")
        if direction in ("a->b", "both"):
            self._add(self.b, ["INPUT", "-s", self.a_ip, "-j", "DROP"])
        if direction in ("b->a", "both"):
            self._add(self.a, ["INPUT", "-s", self.b_ip, "-j", "DROP"])

    def _add(self, ns: str, rule: list[str]) -> None:
        full = [*rule[:1], "-m", "comment", "--comment", self.tag, *rule[1:]]
        run("ip", "netns", "exec", ns, "iptables", "-w", "-A", *full)
        self._rules.append((ns, full))

    def heal(self) -> None:
        while self._rules:
            ns, rule = self._rules.pop()
            run("ip", "netns", "exec", ns, "iptables", "-w", "-D", *rule, check=False)

    def close(self) -> None:
        self.heal()
        while self._created:
            run("ip", "netns", "del", self._created.pop(), check=False)

    def __enter__(self) -> NetnsPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


def owned_namespaces() -> list[str]:
    """Namespaces this process created and has not deleted (for leak checks)."""
    prefix = f"lhc{os.getpid() % 100000}x"
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


# ----------------------------------------------------------------------------- loopback isolation
def cgroup2_root() -> Path:
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "cgroup2":
            return Path(parts[1])
    raise NetError("no cgroup2 hierarchy mounted")


_SS_PORT = re.compile(r"127\.0\.0\.1:(\d+)\s+\S+:(\d+)")


def _socket_ports(pid: int) -> list[tuple[int, int]]:
    """(local port, peer port) of every established TCP socket of ``pid``."""
    out = run("ss", "-tnpH", "state", "established", check=False).stdout
    ports = []
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        m = _SS_PORT.search(line)
        if m:
            ports.append((int(m.group(1)), int(m.group(2))))
    return ports


@dataclass
class MemberIsolation:
    """Isolate one process listening on loopback ``own_port`` from peers on ``peer_ports``,
    with every packet dropped in the kernel (OUTPUT chain, which sees loopback traffic):

    * anything sent to or from ``own_port`` (the peers' connections to it);
    * new connections the process opens to the peers: it is moved into its own cgroup and
      packets from that cgroup to ``peer_ports`` are dropped (a socket keeps the cgroup it was
      created in, so this catches every connection opened after the move);
    * connections it opened before the move: their local ports, listed with ``ss``, are dropped.

    Clients on other ports still reach the process. ``remove`` deletes every rule, moves the
    process back and removes the cgroup."""

    pid: int
    own_port: int
    peer_ports: Sequence[int]
    tag: str = field(default_factory=_tag)
    _rules: list[list[str]] = field(default_factory=list)
    _cgroup: Path | None = None
    _old_cgroup: Path | None = None

    def apply(self) -> None:
        require_net_admin()
        try:
            root = cgroup2_root()
            self._cgroup = root / self.tag
            self._cgroup.mkdir()
            current = next((line[3:] for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines()
                            if line.startswith("0::")), "/")
            self._old_cgroup = root / current.lstrip("/")
            (self._cgroup / "cgroup.procs").write_text(str(self.pid))
            ports = ",".join(str(p) for p in self.peer_ports)
            self._add(["-p", "tcp", "--dport", str(self.own_port)])
            self._add(["-p", "tcp", "--sport", str(self.own_port)])
            if ports:
                self._add(["-p", "tcp", "-m", "cgroup", "--path", self.tag, "-m", "multiport", "--dports", ports])
            for local, peer in _socket_ports(self.pid):
                if peer in self.peer_ports:
                    self._add(["-p", "tcp", "--sport", str(local), "--dport", str(peer)])
                    self._add(["-p", "tcp", "--sport", str(peer), "--dport", str(local)])
        except BaseException:
            self.remove()
            raise

    def _add(self, match: list[str]) -> None:
        rule = ["OUTPUT", "-o", "lo", *match, "-m", "comment", "--comment", self.tag, "-j", "DROP"]
        run("iptables", "-w", "-I", *rule)
        self._rules.append(rule)

    def remove(self) -> None:
        while self._rules:
            run("iptables", "-w", "-D", *self._rules.pop(), check=False)
        if self._cgroup is not None:
            back = self._old_cgroup if self._old_cgroup and self._old_cgroup.exists() else cgroup2_root()
            try:
                (back / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                pass  # the process is gone
            try:
                self._cgroup.rmdir()
            except OSError:
                pass
            self._cgroup = None


def leftover_rules() -> list[str]:
    """iptables rules this process added and did not remove (for leak checks)."""
    marker = f"lhchaos-{os.getpid()}-"
    return [line for line in run("iptables", "-w", "-S", check=False).stdout.splitlines() if marker in line]
