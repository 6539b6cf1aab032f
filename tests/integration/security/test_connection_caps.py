"""How many connections a client in the network can make a service hold, on every door, attacked
through real processes on loopback: the agent's HTTP port (admission API, forward auth), its gRPC
port (RLS, RLQS, health) and the allocator's HTTP port.

Before, none of them had a cap: a client opened connections until the process ran out of file
descriptors (and then could open none of its own: Redis, etcd), each gRPC connection holding up
to 128 streams that never send a message (about 2.5 MB). Now each door holds at most its stated
number of connections (``--http-max-connections``, ``--rls-max-connections``): one more is
answered 503 problem+json and closed (HTTP) or closed as soon as it is accepted (gRPC: its
client's calls are UNAVAILABLE), and connections already open keep being answered. What an
operator sees is read from ``/metrics`` while the attack lasts: the HTTP connections refused and
held against the cap, and the gRPC port's connections against its cap (grpc counts no refusal).

The caps are set through the environment (``LEASEHOLD_AGENT_*``, ``LEASEHOLD_ALLOCATOR_*``), as an
operator may: a build without them ignores the variables, and these tests then fail on what they
check, not on a refused flag."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from kernel.bundle import Pool
from leasehold.local.procs import LOOPBACK, Proc, RedisServer, free_port, wait_http_ready, wait_port
from leasehold.local.services import agent_command, allocator_command
from tests.support.allocator_app import unique_prefix
from tests.support.h2raw import RawConnection
from tests.support.policies import NORTHSTAR, ROOT, write_pools
from tests.support.waiting import wait_until

from .conftest import DIGEST, TOKEN

pytestmark = pytest.mark.integration

HTTP_CAP = 24  # --http-max-connections of both services under attack
RLS_CAP = 8  # --rls-max-connections
STREAMS = 32  # half-open streams the attacker opens on each gRPC connection it holds
RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
META = (("authorization", f"Bearer {TOKEN}"),)
D = ratelimit_pb2.RateLimitDescriptor
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


@dataclass
class Door:
    name: str
    port: int
    proc: Proc
    pid: int

    def log(self) -> str:
        assert self.proc.log_path is not None
        return self.proc.log_path.read_text(errors="replace")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))


def _env(prefix: str, **caps: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER="caps-pepper-not-secret")
    env.update({prefix + k.upper(): str(v) for k, v in caps.items()})
    return env


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Door, int]]:
    """An agent with both ports, and its RLS port."""
    work = Path(tmp_path_factory.mktemp("caps-agent"))
    redis = RedisServer(work / "redis").start()
    port, rls_port = free_port(), free_port()
    proc = Proc("caps-agent", agent_command(
        "--log-level", "info", redis_url=redis.url, policy=NORTHSTAR, region="eu", host=LOOPBACK, port=port,
        rls_port=rls_port, policy_poll_ms=0, auth_disabled=False, gateway_tokens=[f"edge:{DIGEST}"]),
        work / "agent", env=_env("LEASEHOLD_AGENT_", http_max_connections=HTTP_CAP,
                                 rls_max_connections=RLS_CAP)).start()
    try:
        wait_http_ready({f"http://{LOOPBACK}:{port}": proc}, timeout=60)
        wait_port(rls_port, proc=proc.popen, timeout=30)
        yield Door("agent", port, proc, proc.popen.pid), rls_port
    finally:
        proc.stop()
        redis.stop()


@pytest.fixture(scope="module")
def allocator(tmp_path_factory: pytest.TempPathFactory, etcd_cluster) -> Iterator[Door]:
    work = Path(tmp_path_factory.mktemp("caps-allocator"))
    bundle = write_pools(work / "pools.json", [Pool(id="p1", window_ms=60_000, limit=1_000_000, chunk_max=1000)])
    port = free_port()
    proc = Proc("caps-allocator", allocator_command(
        "--log-level", "info", etcd=etcd_cluster.endpoints, policy=bundle, node_id="caps-1", host=LOOPBACK,
        port=port, prefix=unique_prefix(), auth_disabled=False, region_tokens=[f"eu:{DIGEST}"]),
        work / "allocator", env=_env("LEASEHOLD_ALLOCATOR_", http_max_connections=HTTP_CAP)).start()
    try:
        wait_http_ready({f"http://{LOOPBACK}:{port}": proc}, timeout=60)
        yield Door("allocator", port, proc, proc.popen.pid)
    finally:
        proc.stop()


@pytest.fixture(params=["agent", "allocator"])
def http_door(request: pytest.FixtureRequest) -> Door:
    if request.param == "agent":
        return request.getfixturevalue("agent")[0]
    return request.getfixturevalue("allocator")


def _metrics(client: httpx.Client, prefix: str) -> dict[str, float]:
    """The unlabelled samples of ``/metrics`` whose names start with ``prefix``, scraped on the
    client's own (already open) connection."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        if line.startswith(prefix) and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def _metric(client: httpx.Client, name: str) -> float:
    return _metrics(client, name)[name]


def _lines(door: Door, text: str) -> list[str]:
    return [x for x in door.log().splitlines() if text in x]


def test_http_connections_beyond_the_cap_are_refused_and_open_ones_answered(http_door: Door):
    """The attacker (no credential) opens three times the cap's worth of connections and sends
    nothing on them. Those past the cap are answered 503 problem+json (``Retry-After``) and
    closed at once; the process's file descriptors stay within the cap; a client whose
    connection was open before is answered throughout; one WARNING line when refusing starts and
    one INFO line when it ends, whatever the number of refused connections. ``/metrics``, scraped
    on the open connection, counts every refused connection and the held ones against the cap."""
    door = http_door
    base = f"http://{LOOPBACK}:{door.port}"
    fds_before = door.fds()
    held: list[socket.socket] = []
    prefix = f"leasehold_{door.name}_http_"
    with httpx.Client(base_url=base, timeout=10) as client:  # a gateway's kept-alive connection
        assert client.get("/healthz").status_code == 200
        before = _metrics(client, prefix)
        assert before[prefix + "max_connections"] == HTTP_CAP, before
        try:
            for _ in range(3 * HTTP_CAP):  # bounded, loopback only
                held.append(socket.create_connection((LOOPBACK, door.port), timeout=10))
            # the refusals are answered as the server accepts them (later on a loaded machine):
            # read them as they come until the cap's worth are left and the scrape counts them
            # all, bounded well inside the 10 s head timeout (which would close the held ones too)
            refused: list[socket.socket] = []
            answers = []
            deadline = time.monotonic() + 7
            while time.monotonic() < deadline:
                readable, _, _ = select.select([s for s in held if s not in refused], [], [], 0.3)
                for s in readable:
                    s.settimeout(5)
                    data = b""
                    with contextlib.suppress(ConnectionError):
                        while chunk := s.recv(65536):
                            data += chunk
                    refused.append(s)
                    answers.append(data)  # ended: the server closed it
                if len(held) - len(refused) <= HTTP_CAP - 1 and not readable and \
                        _metrics(client, prefix)[prefix + "refused_connections_total"] \
                        - before[prefix + "refused_connections_total"] == len(refused):
                    break
            # the cap's worth are held (less the gateway's one), the rest refused
            assert HTTP_CAP - 1 - 2 <= len(held) - len(refused) <= HTTP_CAP - 1, (len(held), len(refused))
            for data in answers:
                head, _, body = data.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503 "), data[:200]
                assert b"content-type: application/problem+json" in head and b"retry-after: 1" in head, head
                problem = json.loads(body)
                assert problem["status"] == 503 and problem["retriable"] is True, problem
            assert door.fds() <= fds_before + HTTP_CAP + 2, (fds_before, door.fds())
            for _ in range(3):  # the connection open before is answered all along
                assert client.get("/healthz").status_code == 200
            # what an operator sees (scraped on the gateway's connection, open throughout): every
            # refused connection counted, the cap's worth open against the cap
            during = _metrics(client, prefix)
            assert during[prefix + "refused_connections_total"] - before[prefix + "refused_connections_total"] \
                == len(refused), (before, during, len(refused))
            assert during[prefix + "connections"] == 1 + len(held) - len(refused), (during, len(held), len(refused))
            assert during[prefix + "max_connections"] == HTTP_CAP, during
        finally:
            for s in held:
                s.close()
        # the gateway's alone again (the server forgets a closed connection when its event loop gets to it)
        assert wait_until(lambda: _metric(client, prefix + "connections") == 1, 15), _metrics(client, prefix)
        warned = wait_until(lambda: _lines(door, "HTTP connections at the cap of"), 15)
        back = wait_until(lambda: _lines(door, "HTTP connections below the cap of"), 15)
        assert len(warned) == 1 and "WARNING" in warned[0], warned
        assert len(back) == 1 and f"; {len(refused)} refused meanwhile" in back[0], back
    with httpx.Client(base_url=base, timeout=10) as fresh:  # below the cap again: new connections served
        assert fresh.get("/healthz").status_code == 200


def test_a_request_sent_on_a_refused_connection_gets_the_503(agent: tuple[Door, int]):
    """A real HTTP client (its request on the wire before the server's answer) reads the 503
    problem, not a reset, when it connects past the cap."""
    door, _ = agent
    held = [socket.create_connection((LOOPBACK, door.port), timeout=10) for _ in range(HTTP_CAP)]
    try:
        time.sleep(0.3)
        r = httpx.post(f"http://{LOOPBACK}:{door.port}/v1/admit", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"requestId": "caps-0000000001", "tenantId": "atlas", "routeGroup": "read",
                             "principal": {"type": "user", "id": "U-caps"}, "method": "GET"}, timeout=10)
        assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json", r.text
        assert r.headers["retry-after"] == "1" and r.json()["type"].endswith("/too-many-connections")
    finally:
        for s in held:
            s.close()


def _ask(ch: grpc.Channel, user: str) -> rls_pb2.RateLimitResponse:
    q = rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value="atlas"), D.Entry(key="user", value=user), D.Entry(key="route_group", value="read")])])
    return rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(q, metadata=META, timeout=10)


def _hold(port: int) -> RawConnection | None:
    """One attacker connection with ``STREAMS`` half-open calls; None when the port closed it at
    once (it sent no SETTINGS: past the cap)."""
    try:
        c = RawConnection(port)
        c.open(STREAMS, RLS)
    except OSError:
        return None
    try:
        c.settings()
    except (AssertionError, OSError):
        c.close()
        return None
    return c


def test_grpc_connections_beyond_the_cap_are_closed_and_open_ones_answered(agent: tuple[Door, int]):
    """The attacker opens twice the cap's worth of connections, each with half-open streams that
    never send a message, and answers pings (the kernel does for it). Past the cap the port closes
    each at once; the gateway's channel, open before, is decided throughout; the process's file
    descriptors stay within the cap; ``/metrics`` shows the port holding its cap; a new client
    past the cap is UNAVAILABLE (not a hang), and is served once the attacker lets go."""
    door, rls_port = agent
    fds_before = door.fds()
    held: list[RawConnection] = []
    with grpc.insecure_channel(f"{LOOPBACK}:{rls_port}") as gateway, \
            httpx.Client(base_url=f"http://{LOOPBACK}:{door.port}", timeout=10) as metrics:
        assert _ask(gateway, "U-caps-gw").overall_code == rls_pb2.RateLimitResponse.OK
        assert _metrics(metrics, "leasehold_agent_rls_connections")["leasehold_agent_rls_connections"] == 1
        refused = 0
        try:
            for _ in range(2 * RLS_CAP):  # bounded, loopback only
                c = _hold(rls_port)
                if c is None:
                    refused += 1
                else:
                    held.append(c)
            assert len(held) == RLS_CAP - 1 and refused == RLS_CAP + 1, (len(held), refused)
            assert door.fds() <= fds_before + RLS_CAP + 2, (fds_before, door.fds())
            # what an operator sees: the port at its cap (grpc reports no refused connection to count)
            during = _metrics(metrics, "leasehold_agent_rls_")
            assert during["leasehold_agent_rls_connections"] == RLS_CAP, during
            assert during["leasehold_agent_rls_max_connections"] == RLS_CAP, during
            for i in range(5):  # the gateway's connection keeps being decided
                assert _ask(gateway, f"U-caps-gw{i}").overall_code == rls_pb2.RateLimitResponse.OK
            started = time.monotonic()
            # its own connection (grpc would otherwise share the gateway's among the process's channels)
            with grpc.insecure_channel(f"{LOOPBACK}:{rls_port}", options=OWN_CONNECTION) as late, \
                    pytest.raises(grpc.RpcError) as e:
                _ask(late, "U-caps-late")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5
        finally:
            for c in held:
                c.close()
        assert wait_until(lambda: _metric(metrics, "leasehold_agent_rls_connections") == 1, 15), \
            _metrics(metrics, "leasehold_agent_rls_connections")  # the gateway's alone again
    deadline = time.monotonic() + 10
    while True:
        with grpc.insecure_channel(f"{LOOPBACK}:{rls_port}", options=OWN_CONNECTION) as fresh:
            try:
                assert _ask(fresh, "U-caps-after").overall_code == rls_pb2.RateLimitResponse.OK
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the port did not serve new connections after the attack"
                time.sleep(0.2)


def _open_files(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open file limit")


def test_a_low_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path: Path):
    """Started with a soft ``RLIMIT_NOFILE`` of 256 (a shell's or a runtime's default can be
    1,024), an agent reached it long before its caps, and then could open no connection of its
    own. It raises the soft limit to the hard one; below what its caps need it says so."""
    redis = RedisServer(tmp_path / "redis").start()
    port = free_port()
    cmd = agent_command("--log-level", "info", redis_url=redis.url, policy=NORTHSTAR, region="eu", host=LOOPBACK,
                        port=port, policy_poll_ms=0, auth_disabled=False, gateway_tokens=[f"edge:{DIGEST}"])
    proc = Proc("caps-nofile", ["prlimit", "--nofile=256:1500", "--", *cmd], tmp_path / "agent",
                env=_env("LEASEHOLD_AGENT_")).start()
    try:
        wait_http_ready({f"http://{LOOPBACK}:{port}": proc}, timeout=60)
        assert proc.popen is not None
        assert _open_files(proc.popen.pid) == (1500, 1500)
        # 1,000 HTTP connections and the process's own 512 do not fit in 1,500: said once
        assert proc.log_path is not None
        lines = [x for x in proc.log_path.read_text().splitlines() if "open file limit (1500)" in x]
        assert len(lines) == 1 and "WARNING" in lines[0], lines
    finally:
        proc.stop()
        redis.stop()
