"""Retry hints carry an upward, per-decision jitter (I5) without moving the seed's numbers."""

from __future__ import annotations

import math

import pytest

from kernel.bundle import Rule
from region_agent import httpmap
from region_agent.httpmap import RetryJitter, apply_http
from region_agent.models import Decision

USER = Rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
            refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded")


def denied(rid: str, retry_ms: int, **kw) -> Decision:
    d = Decision(allowed=False, decision_id=rid, policy_id="x", policy_version=42, denied_scope="user",
                 reason="RATE_EXCEEDED", limit=20, remaining=0, retry_after_ms=retry_ms, **kw)
    apply_http(d, rule=USER, anonymous=False)
    return d


@pytest.mark.parametrize("retry_ms, header", [(500, "1"), (200, "1"), (420, "1"), (3_500, "4"), (5_000, "5"),
                                              (10_000, "10")])
def test_the_seeds_headers_hold_for_every_decision_id(retry_ms, header):
    """Hints up to 10 s keep max(1, ceil(ms/1000)) whatever the jitter drawn (P-READ -> 1, 3,500 -> 4)."""
    for i in range(300):
        d = denied(f"r-{i:08d}", retry_ms)
        assert d.headers["Retry-After"] == header
        assert d.retry_after_ms == retry_ms  # the store's hint itself is never changed
        assert 0 <= d.retry_jitter_ms < max(1, retry_ms // 10)


def test_long_hints_spread_upward_and_never_below_the_true_hint():
    """Clients denied together until a window reset (58 s) retry over several seconds, not at once."""
    headers = set()
    for i in range(500):
        d = denied(f"w-{i:08d}", 58_000)
        secs = int(d.headers["Retry-After"])
        assert secs >= math.ceil(58_000 / 1000)
        assert secs == 58 + d.retry_jitter_ms // 1000 and d.retry_jitter_ms < 5_000  # 10 %, at most 5 s
        headers.add(secs)
    assert headers == {58, 59, 60, 61, 62}


def test_jitter_is_a_pure_function_of_seed_and_decision_id():
    j = RetryJitter(10, 5_000, b"seed-a")
    assert j.of("r-1", 30_000) == j.of("r-1", 30_000)  # a retried request gets the same hint
    spread = {j.of(f"r-{i}", 30_000) for i in range(200)}
    assert len(spread) > 150  # different requests spread
    other = RetryJitter(10, 5_000, b"seed-b")
    assert [j.of(f"r-{i}", 30_000) for i in range(20)] != [other.of(f"r-{i}", 30_000) for i in range(20)]
    assert RetryJitter(0, 5_000).of("r-1", 30_000) == 0  # disabled
    assert j.of("r-1", 0) == 0 and j.of("r-1", -1) == 0  # allowed / never-satisfiable: no jitter


def test_configure_jitter_switches_the_module_default():
    try:
        httpmap.configure_jitter(0, 0)
        assert denied("r-00000001", 58_000).retry_jitter_ms == 0
    finally:
        httpmap.configure_jitter(10, 5_000)
