"""The agent's gRPC port under attack from inside the mesh while a real Envoy on the shipped
``envoy-rls.yaml`` asks it. A process without any credential opened more half-open streams
than the port had slots (headers, never a message): before, every call of Envoy's was
``RESOURCE_EXHAUSTED``, and the file's read routes (``failure_mode_deny: false``) let every
request through without a decision, the user's limit gone. The port's slots are now the agent's,
taken only by authenticated calls while they are decided: the limit holds."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from leasehold.local.gateways import Envoy
from tests.support.h2raw import RawConnection

from .conftest import Stack, assert_p_read, identity

pytestmark = pytest.mark.e2e

SLOTS = 4_096  # the agent's --rls-max-concurrent-rpcs (its default)
PER_CONNECTION = 256  # its --rls-max-streams-per-connection (its default)
RLS = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


@pytest.fixture(scope="module")
def rls_envoy(stack: Stack) -> Iterator[Envoy]:
    e = stack.envoy("envoy-rls-door", "envoy-rls.yaml")
    yield e
    e.stop()


def test_half_open_streams_from_the_mesh_do_not_turn_the_limiter_off(stack: Stack, rls_envoy: Envoy):
    conns: list[RawConnection] = []
    try:
        for _ in range(SLOTS // PER_CONNECTION + 1):  # more streams than slots, each connection full
            c = RawConnection(stack.rls_port)
            c.open(PER_CONNECTION, RLS)
            conns.append(c)
        stack.full_frozen_bucket("U-door")
        before = stack.metric("leasehold_agent_rls_requests_total", outcome="ok")
        with httpx.Client(base_url=rls_envoy.url, timeout=10) as client:
            responses = [client.get("/catalog", headers=identity("U-door")) for _ in range(21)]
        assert_p_read(responses)  # 20 pass, the 21st is the user's 429: decided, not let through
        assert stack.metric("leasehold_agent_rls_requests_total", outcome="ok") - before == 20
        assert rls_envoy.stats("cluster.upstream.ratelimit.").get("cluster.upstream.ratelimit.failure_mode_allowed",
                                                                   0) == 0
    finally:
        for c in conns:
            c.close()
