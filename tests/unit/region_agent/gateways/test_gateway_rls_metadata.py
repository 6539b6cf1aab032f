"""The RLS door reads a call's metadata only when something needs it (region_agent.gateways.rls):
the gateway token (authentication on) or a trace's context (tracing on). A call decided with its
group under --auth-disabled and no tracing never asks grpc for it; the answer is the same."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client import CollectorRegistry

from kernel.auth import TokenTable, hash_token
from region_agent.gateways.mapping import Names
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.rls import RateLimitServicer
from region_agent.models import Decision

D = ratelimit_pb2.RateLimitDescriptor


class Context:
    """What the servicer asks of grpc's ServicerContext; counts the metadata reads."""

    def __init__(self, metadata: tuple = ()):
        self.metadata = metadata
        self.reads = 0

    def invocation_metadata(self):
        self.reads += 1
        return self.metadata


async def admission(questions, **_):
    """The admission at this unit's boundary: every question allowed (real answers:
    tests/integration/region_agent/test_gateways.py)."""
    await asyncio.sleep(0)
    return [Decision(allowed=True, decision_id=f"d-{q.request_id}", rule_id=None, bundle_version=1) for q in questions]


def request(u: str) -> bytes:
    """A call's bytes, as grpcio hands them to the servicer."""
    return rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value="atlas"), D.Entry(key="user", value=u),
        D.Entry(key="route_group", value="read")])]).SerializeToString()


def servicer(gateways: TokenTable | None) -> RateLimitServicer:
    return RateLimitServicer(names=Names.build(), decide=admission, snapshot_of=lambda: SimpleNamespace(rules_by_id={}),
                             gateways=gateways, metrics=GatewayMetrics(CollectorRegistry()), group_linger_s=0.005)


async def test_calls_of_a_group_without_auth_or_tracing_never_read_their_metadata():
    s = servicer(None)
    contexts = [Context() for _ in range(4)]
    answers = await asyncio.wait_for(asyncio.gather(*(s.ShouldRateLimit(request(f"U-{i}"), c)
                                                      for i, c in enumerate(contexts))), 10)
    assert [rls_pb2.RateLimitResponse.FromString(a).overall_code for a in answers] == [rls_pb2.RateLimitResponse.OK] * 4
    assert [c.reads for c in contexts] == [0, 0, 0, 0]


async def test_with_gateway_tokens_every_call_reads_its_metadata_once():
    s = servicer(TokenTable([("envoy", hash_token("secret-token-0123456789"))]))
    contexts = [Context((("authorization", "Bearer secret-token-0123456789"),)) for _ in range(3)]
    answers = await asyncio.wait_for(asyncio.gather(*(s.ShouldRateLimit(request(f"U-{i}"), c)
                                                      for i, c in enumerate(contexts))), 10)
    assert [rls_pb2.RateLimitResponse.FromString(a).overall_code for a in answers] == [rls_pb2.RateLimitResponse.OK] * 3
    assert [c.reads for c in contexts] == [1, 1, 1]


async def test_the_calls_counted_outside_the_registry_read_exact_at_every_collection():
    """The door counts answered calls in plain Python (GatewayMetrics.add_flush): a collection reads
    each call once, a second collection adds nothing, and the latency histogram's buckets are
    observe()'s (every call in one bucket, the cumulative +Inf bucket the count)."""
    registry = CollectorRegistry()
    s = RateLimitServicer(names=Names.build(), decide=admission, snapshot_of=lambda: SimpleNamespace(rules_by_id={}),
                          gateways=None, metrics=GatewayMetrics(registry), group_linger_s=0.005)
    get = registry.get_sample_value
    for n in (3, 5):
        await asyncio.wait_for(asyncio.gather(*(s.ShouldRateLimit(request(f"U-{i}"), Context()) for i in range(n))), 10)
    assert get("leasehold_agent_rls_requests_total", {"outcome": "ok"}) == 8
    assert get("leasehold_agent_rls_requests_total", {"outcome": "ok"}) == 8  # (collected again: nothing added)
    assert get("leasehold_agent_rls_descriptors_total", {"code": "OK"}) == 8
    assert get("leasehold_agent_rls_descriptors_total", {"code": "OVER_LIMIT"}) == 0
    assert get("leasehold_agent_rls_seconds_count") == 8 == get("leasehold_agent_rls_seconds_bucket", {"le": "+Inf"})
    assert 0 < get("leasehold_agent_rls_seconds_sum") < 10
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):  # a refused call: counted the same way
        await s.ShouldRateLimit(b"\xff\xff", RefusingContext())
    assert get("leasehold_agent_rls_requests_total", {"outcome": "invalid"}) == 1
    assert get("leasehold_agent_rls_seconds_count") == 9


class RefusingContext(Context):
    async def abort(self, code, detail):
        raise RuntimeError(f"aborted {code}")


async def test_a_call_of_one_question_is_asked_of_the_admissions_single_decision():
    """A call of one descriptor decided alone is asked through ``decide_one`` (the admission's
    single decision, no lists) with what ``decide`` would get — the door, the call's trace
    carrier, ``decoded`` — and answers as the same call asked through ``decide``; a call of
    several descriptors, or one decided with its group, goes through ``decide`` as before."""
    asked: list[tuple[str, object, dict]] = []

    async def decide(questions, **kw):
        asked.append(("decide", [q.route_group for q in questions], kw))
        return await admission(questions)

    async def decide_one(question, **kw):
        asked.append(("decide_one", question.route_group, kw))
        (d,) = await admission([question])
        return d

    def make(one):
        return RateLimitServicer(names=Names.build(), decide=decide, decide_one=one,
                                 snapshot_of=lambda: SimpleNamespace(rules_by_id={}), gateways=None,
                                 metrics=GatewayMetrics(CollectorRegistry()))

    with_one, without = make(decide_one), make(None)
    two = rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
        D.Entry(key="tenant", value="atlas"), D.Entry(key="user", value=u), D.Entry(key="route_group", value="read")])
        for u in ("U-1", "U-2")]).SerializeToString()
    for raw in (request("U-1"), two):
        a = await with_one.ShouldRateLimit(raw, Context())
        b = await without.ShouldRateLimit(raw, Context())
        assert rls_pb2.RateLimitResponse.FromString(a) == rls_pb2.RateLimitResponse.FromString(b)
    kw = {"door": "rls", "carrier": (), "decoded": True}
    assert asked == [("decide_one", "read", kw), ("decide", ["read"], kw),  # (without decide_one: a list of one)
                     ("decide", ["read", "read"], kw), ("decide", ["read", "read"], kw)]
