"""The RLS port's slots are counted by the servicer (region_agent.gateways.rls.RateLimitServicer;
docs/decisions/0068-the-grpc-ports-slots-are-the-agents.md): the calls being decided and the
RLQS streams open, at most --rls-max-concurrent-rpcs; a call past them is RESOURCE_EXHAUSTED,
counted ``exhausted``, and gives its slot back; a call decided gives its slot back before its
answer is read."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry

from region_agent.gateways.mapping import Names
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.rls import RateLimitServicer
from region_agent.models import Decision

from .test_gateway_rls_metadata import RefusingContext, request


async def test_a_call_past_the_slots_is_resource_exhausted_and_counted():
    release = asyncio.Event()

    async def slow(questions, **_):  # the admission holds its calls until released
        await release.wait()
        return [Decision(allowed=True, decision_id=f"d-{q.request_id}", rule_id=None, bundle_version=1)
                for q in questions]

    registry = CollectorRegistry()
    streams = [1]  # one RLQS stream open
    s = RateLimitServicer(names=Names.build(), decide=slow, snapshot_of=lambda: SimpleNamespace(rules_by_id={}),
                          gateways=None, metrics=GatewayMetrics(registry), max_slots=3,
                          streams_open=lambda: streams[0])
    held = [asyncio.ensure_future(s.ShouldRateLimit(request(f"U-{i}"), RefusingContext())) for i in range(2)]
    await asyncio.sleep(0.01)  # two calls being decided + one stream: every slot taken
    with pytest.raises(RuntimeError, match=str(grpc.StatusCode.RESOURCE_EXHAUSTED)):
        await s.ShouldRateLimit(request("U-past"), RefusingContext())
    assert registry.get_sample_value("leasehold_agent_rls_requests_total", {"outcome": "exhausted"}) == 1
    streams[0] = 0  # the stream closed: a slot is free
    third = asyncio.ensure_future(s.ShouldRateLimit(request("U-third"), RefusingContext()))
    release.set()
    answers = await asyncio.wait_for(asyncio.gather(*held, third), 10)
    assert [rls_pb2.RateLimitResponse.FromString(a).overall_code for a in answers] == [rls_pb2.RateLimitResponse.OK] * 3
    assert s.group.in_flight == 0  # every slot given back once decided
