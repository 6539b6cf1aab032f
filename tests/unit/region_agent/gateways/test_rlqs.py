"""region_agent.gateways.rlqs: one funding round of a bucket, with an in-process admission and a
manual clock (the stream, Envoy and the real admission: tests/e2e/gateways)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.rlqs import Bucket, RlqsService, Stream
from region_agent.gateways.rlqs_mapping import Ttl
from region_agent.leasing import rlqs_funding as f
from region_agent.models import AdmitRequest, Decision, Principal
from tests.support.clock import FakeClock

Q = AdmitRequest(request_id="rlqs-bucket", principal=Principal(type="user", id="U-1"), route_group="read",
                 tenant_id="atlas")
KEY = (("user", "U-1"),)


def service(bucket_has: list[int], clock: FakeClock) -> tuple[RlqsService, list[int]]:
    """An agent whose bucket holds ``bucket_has[0]`` tokens; returns it and the costs it was asked."""
    asked: list[int] = []

    async def decide(qs: list[AdmitRequest]) -> list[Decision]:
        (q,) = qs
        asked.append(q.cost_hint)
        ok = q.cost_hint <= bucket_has[0]
        if ok:
            bucket_has[0] -= q.cost_hint
        return [Decision(allowed=ok, decision_id=q.request_id, rule_id="read-user", bundle_version=1,
                         remaining=bucket_has[0], http_status=200 if ok else 429, retry_after_ms=0 if ok else 500)]

    svc = RlqsService(settings=SimpleNamespace(rlqs_report_interval_ms=5_000, rlqs_max_assignment=100),
                      names=None, decide=decide, state_of=lambda: None,
                      metrics=GatewayMetrics(CollectorRegistry()), gateways=None, clock=clock)
    svc.ttl_for = lambda b: Ttl(10, 0, math.inf, True)  # type: ignore[method-assign]  # no policy windows here
    return svc, asked


def holder(svc: RlqsService, bucket: Bucket, stream_id: int, demand: float) -> f.Holding:
    st = Stream(stream_id, f"peer-{stream_id}")
    svc.streams[stream_id] = st
    h = f.Holding(stream=stream_id, bucket=KEY, question=Q, demand=demand)
    st.holdings[KEY] = h
    bucket.holdings.add(h)
    return h


async def test_a_round_one_envoy_started_shares_the_bucket_with_a_short_one_by_demand():
    """A (8 requests/s) came out of its last round short and waits out the denial's hint; B (2/s)
    reports and starts a round alone. Alone, B would take all the bucket has (its 10 tokens are
    under B's need of 12); with A waiting, the round asks for both and shares by demand."""
    clock = FakeClock(100.0)  # seconds
    svc, asked = service([10], clock)
    bucket = Bucket(KEY, Q, None, burst=20)
    svc.buckets[KEY] = bucket
    a, b = holder(svc, bucket, 1, 8.0), holder(svc, bucket, 2, 2.0)
    a.short_at_ms, a.retry_at_ms = 99_500.0, 100_400.0  # its round half a second ago got nothing
    b.wanting = True
    await svc._round(bucket)
    assert asked == [20, 10]  # both needs (48 + 12) up to the burst, then what the denial said was left
    assert (a.chunk, b.chunk) == (8, 2)
    assert a.short_at_ms == b.short_at_ms == 100_000.0  # both still got less than they asked
    for st in svc.streams.values():
        st.flush()
        assert st.queue.qsize() == 1  # each Envoy was sent its assignment


async def test_an_envoy_funded_in_full_is_not_short_and_joins_no_other_round():
    clock = FakeClock(100.0)
    svc, asked = service([100], clock)
    bucket = Bucket(KEY, Q, None, burst=100)
    svc.buckets[KEY] = bucket
    a, b = holder(svc, bucket, 1, 8.0), holder(svc, bucket, 2, 2.0)
    a.wanting = True
    await svc._round(bucket)
    assert (a.chunk, a.short_at_ms, b.chunk) == (48, 0.0, 0)  # b neither reported nor was short: not asked
    clock.advance(1.0)
    b.wanting = True
    await svc._round(bucket)
    assert asked == [48, 12] and (a.chunk, b.chunk) == (48, 12)
