"""The agent's gRPC port under attack from inside the mesh while real Envoys on the shipped
``envoy-rls.yaml`` and ``envoy-rlqs.yaml`` ask it. A process without any credential opened more half-open streams
than the port had slots (headers, never a message): before, every call of Envoy's was
``RESOURCE_EXHAUSTED``, and the file's read routes (``failure_mode_deny: false``) let every
request through without a decision, the user's limit gone; an Envoy on ``envoy-rlqs.yaml`` got no
quota stream (``RESOURCE_EXHAUSTED``), so no assignment, and denied every request. The port's
slots are now the agent's, taken only by authenticated calls while they are decided and by open
quota streams: the limit holds, and quota is assigned.

A process without any credential also opened as many connections as it liked, each holding
half-open streams; the port now holds at most ``--rls-max-connections`` and closes one more at
once: Envoy's connection, open before, keeps being decided while the attacker holds the rest."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasehold.local.gateways import Envoy
from leasehold.local.procs import LOOPBACK
from tests.support.h2raw import RawConnection

from .conftest import Stack, access_log, assert_p_read, identity, rlqs_envoy
from .test_envoy_rlqs import debited, until_admitted

pytestmark = pytest.mark.e2e

SLOTS = 64  # the agent's --rls-max-concurrent-rpcs: few, so that a few connections' streams outnumber them
PER_CONNECTION = 40  # what the attacker opens per connection (below --rls-max-streams-per-connection, 128)
CONNECTIONS = 16  # the agent's --rls-max-connections
RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


@pytest.fixture(scope="module")
def extra_agent_args() -> tuple[str, ...]:
    return ("--rls-max-concurrent-rpcs", str(SLOTS), "--rlqs-max-streams", "8", "--rls-max-connections", str(CONNECTIONS))


@pytest.fixture(scope="module")
def rls_envoy(stack: Stack) -> Iterator[Envoy]:
    e = stack.envoy("envoy-rls-door", "envoy-rls.yaml")
    yield e
    e.stop()


def flood(stack: Stack) -> list[RawConnection]:
    """More half-open streams than the port has slots, each connection full, no credential."""
    conns: list[RawConnection] = []
    for _ in range(SLOTS // PER_CONNECTION + 1):
        c = RawConnection(stack.rls_port)
        conns.append(c)
        c.open(PER_CONNECTION, RLS)
    # answered once the agent has taken them (before, refused: RESOURCE_EXHAUSTED like every call)
    with grpc.insecure_channel(f"{LOOPBACK}:{stack.rls_port}") as ch, contextlib.suppress(grpc.RpcError):
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
    return conns


def test_half_open_streams_from_the_mesh_do_not_turn_the_limiter_off(stack: Stack, rls_envoy: Envoy):
    conns: list[RawConnection] = []
    try:
        conns = flood(stack)
        stack.full_frozen_bucket("U-door")
        before = stack.metric("leasehold_agent_rls_requests_total", outcome="ok")
        with httpx.Client(base_url=rls_envoy.url, timeout=10) as client:
            responses = [client.get("/catalog", headers=identity("U-door")) for _ in range(21)]
        stats = rls_envoy.stats("cluster.upstream.ratelimit.")
        outcomes = {o: stack.metric("leasehold_agent_rls_requests_total", outcome=o) for o in ("ok", "exhausted")}
        assert stats.get("cluster.upstream.ratelimit.failure_mode_allowed", 0) == 0, stats
        assert outcomes["ok"] - before == 20 and not outcomes["exhausted"], outcomes
        assert_p_read(responses)  # 20 pass, the 21st is the user's 429: decided, not let through
    finally:
        for c in conns:
            c.close()


def test_half_open_streams_from_the_mesh_do_not_keep_quota_from_envoy(stack: Stack):
    conns: list[RawConnection] = []
    envoy = None
    try:
        conns = flood(stack)
        stack.full_frozen_bucket("U-door-q")
        envoy = rlqs_envoy(stack, "envoy-rlqs-door")  # its quota stream opens while the port is flooded
        with httpx.Client(base_url=envoy.url, timeout=10) as client:
            codes = [r.status_code for r in until_admitted(client, "U-door-q")]
            codes += [client.get("/catalog", headers=identity("U-door-q")).status_code for _ in range(30)]
        assert 1 <= codes.count(200) <= debited(stack, "U-door-q") <= 20, codes  # the bound holds
        assert access_log(envoy, len(codes))
    finally:
        for c in conns:
            c.close()
        if envoy is not None:
            envoy.stop()


def test_an_attacker_holding_every_connection_leaves_envoy_deciding(stack: Stack, rls_envoy: Envoy):
    """The attacker opens connections in a bounded loop until the port closes them at once (it
    answers pings: the kernel does), each holding half-open streams. Envoy's own connection was
    open before: its requests are decided while the attacker holds every other one."""
    stack.full_frozen_bucket("U-conns")
    held: list[RawConnection] = []
    with httpx.Client(base_url=rls_envoy.url, timeout=10) as client:
        assert client.get("/catalog", headers=identity("U-conns-warm")).status_code == 200  # Envoy's connection
        try:
            refused = 0
            for _ in range(2 * CONNECTIONS):  # bounded, loopback only
                c = RawConnection(stack.rls_port)
                try:
                    c.open(PER_CONNECTION, RLS)
                    c.settings(1.0)
                    held.append(c)
                except (AssertionError, OSError):  # closed by the port at once: past the cap
                    c.close()
                    refused += 1
            assert refused >= CONNECTIONS and len(held) < CONNECTIONS, (len(held), refused)
            before = stack.metric("leasehold_agent_rls_requests_total", outcome="ok")
            responses = [client.get("/catalog", headers=identity("U-conns")) for _ in range(21)]
            stats = rls_envoy.stats("cluster.upstream.ratelimit.")
            assert stats.get("cluster.upstream.ratelimit.failure_mode_allowed", 0) == 0, stats
            assert stack.metric("leasehold_agent_rls_requests_total", outcome="ok") - before == 20
            assert_p_read(responses)  # decided: 20 pass, the 21st is the user's 429
        finally:
            for c in held:
                c.close()
