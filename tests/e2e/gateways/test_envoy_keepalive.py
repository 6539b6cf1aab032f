"""The RLS port's keepalive (``--rls-keepalive-ms``) against a real Envoy on the shipped
``envoy-rlqs.yaml``: the port pings every connection and cuts off a peer that answers no ping
(docs/decisions/0068-the-grpc-ports-slots-are-the-agents.md); Envoy answers them, so its quota
stream — idle between reports for far longer than the keepalive here — is never cut off."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from leasehold.local.gateways import Envoy

from .conftest import Stack, hammer, rlqs_envoy

pytestmark = pytest.mark.e2e

KEEPALIVE_MS = 500


@pytest.fixture(scope="module")
def extra_agent_args() -> tuple[str, ...]:
    return ("--rls-keepalive-ms", str(KEEPALIVE_MS))


@pytest.fixture(scope="module")
def envoy(stack: Stack) -> Iterator[Envoy]:
    e = rlqs_envoy(stack, "envoy-rlqs-keepalive")
    yield e
    e.stop()


def test_an_envoy_that_answers_pings_keeps_its_quota_stream(stack: Stack, envoy: Envoy):
    codes = hammer(envoy, "U-keepalive", seconds=2.0, every_s=0.2)  # its bucket gets an assignment
    assert 200 in codes, codes
    opened = stack.metric("leasehold_agent_rlqs_streams")
    assert opened >= 1
    time.sleep(12 * KEEPALIVE_MS / 1000)  # many pings, no report in between for most of them
    assert stack.metric("leasehold_agent_rlqs_streams") == opened
    assert envoy.stats("cluster.leasehold_rls.").get("cluster.leasehold_rls.upstream_cx_total") == 1  # never reconnected
    assert 200 in hammer(envoy, "U-keepalive", seconds=2.0, every_s=0.2)
