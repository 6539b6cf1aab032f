"""Retry hints carry an upward, per-decision jitter (I5): Retry-After's whole seconds spread over
at least about one second, never below the exact hint."""

from __future__ import annotations

import math

import pytest

from kernel.bundle import make_rule
from region_agent.decision.httpmap import HttpAnswers, RetryJitter, apply_http
from region_agent.models import Decision

USER = make_rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
            refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded")


DEFAULT = HttpAnswers()  # the agent's defaults: 10 %, at least 1 s, at most 5 s


def denied(rid: str, retry_ms: int, answers: HttpAnswers = DEFAULT, **kw) -> Decision:
    d = Decision(allowed=False, decision_id=rid, rule_id="x", bundle_version=42, denied_scope="user",
                 reason="RATE_EXCEEDED", limit=20, remaining=0, retry_after_ms=retry_ms, **kw)
    apply_http(d, rule=USER, anonymous=False, answers=answers)
    return d


@pytest.mark.parametrize("retry_ms", [500, 200, 420, 1_000, 3_500, 5_000, 10_000])
def test_short_hints_spread_the_whole_seconds_over_about_one_second(retry_ms):
    """10,000 clients told the same short hint must not all come back in the same second: the
    Retry-After values of many decisions spread over the hint's whole second and the next
    (P-READ's 500 ms: 1 or 2, about half each), never below the exact hint rounded up, and
    always the whole seconds of retryAfterMs + retryJitterMs."""
    seen: dict[int, int] = {}
    for i in range(1_000):
        d = denied(f"r-{i:08d}", retry_ms)
        secs = int(d.headers["Retry-After"])
        assert d.retry_after_ms == retry_ms  # the store's hint itself is never changed
        assert 0 <= d.retry_jitter_ms < 1_000  # 10 % of a hint under 10 s is less than the 1 s floor
        assert secs == max(1, math.ceil((retry_ms + d.retry_jitter_ms) / 1000))
        assert secs >= math.ceil(retry_ms / 1000)
        seen[secs] = seen.get(secs, 0) + 1
    lo = max(1, math.ceil(retry_ms / 1000))
    assert set(seen) <= {lo, lo + 1}
    share = (lo * 1000 - retry_ms) / 1000  # the part of [hint, hint + 1 s) within the first whole second
    if 0.1 < share < 0.9:  # both seconds are drawn, in about those proportions
        assert abs(seen.get(lo, 0) / 1_000 - share) < 0.08, seen


def test_long_hints_spread_upward_and_never_below_the_true_hint():
    """Clients denied together until a window reset (58 s) retry over several seconds, not at once."""
    headers = set()
    for i in range(500):
        d = denied(f"w-{i:08d}", 58_000)
        secs = int(d.headers["Retry-After"])
        assert secs >= math.ceil(58_000 / 1000)
        assert secs == math.ceil((58_000 + d.retry_jitter_ms) / 1000) and d.retry_jitter_ms < 5_000  # 10 %, ≤ 5 s
        headers.add(secs)
    assert {59, 60, 61, 62, 63} <= headers <= {58, 59, 60, 61, 62, 63}


def test_jitter_is_a_pure_function_of_seed_and_decision_id():
    j = RetryJitter(10, 5_000, b"seed-a")
    assert j.of("r-1", 30_000) == j.of("r-1", 30_000)  # a retried request gets the same hint
    spread = {j.of(f"r-{i}", 30_000) for i in range(200)}
    assert len(spread) > 150  # different requests spread
    other = RetryJitter(10, 5_000, b"seed-b")
    assert [j.of(f"r-{i}", 30_000) for i in range(20)] != [other.of(f"r-{i}", 30_000) for i in range(20)]
    assert RetryJitter(0, 5_000, min_ms=0).of("r-1", 30_000) == 0  # disabled
    assert RetryJitter(10, 0).of("r-1", 30_000) == 0  # disabled
    assert {RetryJitter(10, 5_000, b"s").of(f"r-{i}", 500) < 1_000 for i in range(50)} == {True}  # the 1 s floor
    assert j.of("r-1", 0) == 0 and j.of("r-1", -1) == 0  # allowed / never-satisfiable: no jitter


def test_jitter_off_gives_the_plain_hint():
    off = HttpAnswers(RetryJitter(0, 0))
    assert denied("r-00000001", 58_000, off).retry_jitter_ms == 0
    assert denied("r-00000001", 500, off).headers["Retry-After"] == "1"  # the plain max(1, ceil(ms / 1000))
    assert denied("r-00000001", 58_000).retry_jitter_ms > 0  # the default answers another way: nothing shared
