"""The RLQS stream's bucket actions over time (region_agent.gateways.rlqs), on a clock the test
moves: what Envoy would receive, in order, from a stream that stopped reporting — a stalled
connection that will deliver everything at once when it resumes."""

from __future__ import annotations

from types import SimpleNamespace

from envoy.service.rate_limit_quota.v3 import rlqs_pb2
from prometheus_client import CollectorRegistry

from region_agent.gateways.metrics import GatewayMetrics
from region_agent.gateways.rlqs import Bucket, RlqsService, Stream
from region_agent.gateways.rlqs_mapping import (
    RlqsNames,
    Ttl,
    assignment_ttl,
    bucket_key,
    bucket_question,
    fixed_window_end,
)
from region_agent.models import Decision

NAMES = RlqsNames.build()
ENTRIES = {"tenant": "birch", "user": "E-0", "route_group": "read"}
KEY = bucket_key(ENTRIES.items())
SETTINGS = SimpleNamespace(rlqs_report_interval_ms=5_000, rlqs_max_ttl_s=10, rlqs_idle_ms=60_000,
                           rlqs_max_buckets=100, rlqs_max_assignment=100, rlqs_clock_margin_ms=250)


class Clock:
    def __init__(self) -> None:
        self.ms = 100_000.0

    def __call__(self) -> float:
        return self.ms / 1000.0


async def allow(questions):
    return [Decision(allowed=True, decision_id="d", rule_id="r", bundle_version=1) for _ in questions]


def service(clock: Clock) -> RlqsService:
    state = SimpleNamespace(holder=SimpleNamespace(bundle=None), engine=object())
    svc = RlqsService(settings=SETTINGS, names=NAMES, decide=allow, state_of=lambda: state,
                      metrics=GatewayMetrics(CollectorRegistry()), gateways=None, clock=clock)
    q = bucket_question(NAMES, NAMES.domain, KEY, cost=1, request_id="rlqs-bucket")
    svc.buckets[KEY] = Bucket(KEY, q, None, b"", burst=100)
    svc.ttl_for = lambda b: Ttl(5, 0, 5_650.0, True)  # 5 s; the window's end (less the margin) in 5.65 s
    return svc


def report(allowed: int, denied: int) -> rlqs_pb2.RateLimitQuotaUsageReports:
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain=NAMES.domain)
    u = msg.bucket_quota_usages.add(num_requests_allowed=allowed, num_requests_denied=denied)
    u.bucket_id.bucket.update(ENTRIES)
    return msg


def received(st) -> list[tuple[str, int]]:
    """What Envoy would receive on the stream, in order: ("deny" | "tokens", ttl or tokens)."""
    out = []
    while not st.queue.empty():
        resp = st.queue.get_nowait()
        for a in resp.bucket_action:
            s = a.quota_assignment_action.rate_limit_strategy
            if s.HasField("token_bucket"):
                out.append(("tokens", s.token_bucket.max_tokens))
            elif s.HasField("blanket_rule") and s.blanket_rule == s.DENY_ALL:
                out.append(("deny", a.quota_assignment_action.assignment_time_to_live.seconds))
            else:
                out.append(("other", 0))
    return out


async def settle(svc: RlqsService) -> None:
    for b in list(svc.buckets.values()):
        if b.round is not None:
            await b.round


async def test_every_assignment_on_a_stalled_stream_is_ended_before_its_windows_end():
    """The stream stalls after one report: nothing more arrives from Envoy, and what the agent sends
    waits until the stream resumes, then arrives all at once. Envoy starts a time to live when an
    assignment *arrives*, so a token bucket that is the last word on the stream when its window
    ends could be spent after that end, from tokens of a window that is over. At every window end,
    the last action sent for the bucket is a DENY_ALL: whenever the stream resumes, Envoy applies
    it after the assignments queued before it."""
    clock = Clock()
    clock.ms = 6_000.0 * 20_000 + 100  # 100 ms into a 6 s window
    svc = service(clock)
    svc.ttl_for = lambda b: assignment_ttl([fixed_window_end(6_000, clock.ms)], max_ttl_s=10, margin_ms=250)
    st = svc.streams.setdefault(1, Stream(1, "envoy-a"))
    svc.on_report(st, report(0, 1))  # the last report before the stall: 1 request a second
    sent: list[tuple[float, str, int]] = []
    ends = []
    for _ in range(180):  # 18 s, three windows, not one report
        await settle(svc)
        sent += [(clock.ms, kind, n) for kind, n in received(st)]
        if clock.ms % 6_000 == 0:
            ends.append(clock.ms)
            before = [a for a in sent if a[0] < clock.ms]
            assert before and before[-1][1] == "deny", (clock.ms, sent[-4:])
        clock.ms += 100
        svc.tick()
    assert len(ends) == 3
    tokens = [a for a in sent if a[1] == "tokens"]
    assert len(tokens) >= 3  # an assignment in each window: not a test that sends nothing
    assert svc.metrics.rlqs_assignments.labels("end")._value.get() >= 3
    await svc.stop()


async def test_an_assignment_replaced_before_it_ran_out_has_no_end_of_its_own():
    clock = Clock()
    svc = service(clock)
    st = svc.streams.setdefault(1, Stream(1, "envoy-a"))
    svc.on_report(st, report(0, 6))
    await settle(svc)
    received(st)
    for _ in range(30):  # 3 s of reports that spend it quickly: replaced by fresh ones, never ended
        clock.ms += 100
        svc.on_report(st, report(4, 0))
        svc.tick()
        await settle(svc)
    assert svc.metrics.rlqs_assignments.labels("fresh")._value.get() >= 2
    assert svc.metrics.rlqs_assignments.labels("end")._value.get() == 0
    await svc.stop()
