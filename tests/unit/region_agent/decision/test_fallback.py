"""The in-process allowances while Redis is unreachable (region_agent/decision/fallback.py): one local
model (the multi-rule step over local states) for a rule's fallback bucket or window and for a
pool's allowance, counted per allocator window, every candidate window charged, never evicted."""

from __future__ import annotations

from kernel.bundle import Fallback, make_rule
from region_agent.decision.fallback import LocalAllowances, pool_item, rule_item
from region_agent.leasing.window_clock import Windows

READ = make_rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket",
                 capacity_millis=20_000, refill_millis=2_000, period_ms=1_000, cost_millis=1_000,
                 fail_mode="local_bounded", fallback=Fallback(capacity_millis=5_000, refill_millis=250, period_ms=1_000))
ANON = make_rule(id="anon-login", scope="ip", route_group="login", algorithm="fixed_window", limit=20,
                 window_ms=10_000, fail_mode="local_bounded", fallback=Fallback(limit=5, window_ms=10_000))


def win(lo: int, hi: int | None = None, end: int = 500) -> Windows:
    return Windows(lo, lo if hi is None else hi, end, end)


def pool(a: LocalAllowances, pool_id: str, w: Windows, tokens: int, limit: int):
    item = pool_item(pool_id, w, tokens, limit, 60_000)
    assert item is not None
    return a.admit([item], 1_000)


# --- a rule's fallback ---------------------------------------------------------------------------
def test_local_bucket_is_bounded_by_its_capacity_and_refill():
    fb = LocalAllowances(max_keys=10)
    item = [rule_item(READ, "k", 1)]
    assert [fb.admit(item, 1_000).allowed for _ in range(6)] == [True] * 5 + [False]
    denied = fb.admit(item, 1_000)
    assert denied.retry_after_ms == 4_000 and denied.denied_by == 1 and denied.remaining == (0,)
    assert fb.admit(item, 5_000).allowed and not fb.admit(item, 5_000).allowed  # 0.25/s: one token per 4 s


def test_local_window_and_all_or_nothing():
    fb = LocalAllowances()
    both = [rule_item(ANON, "ip", 1), rule_item(READ, "u", 1)]
    assert all(fb.admit(both, 1_000).allowed for _ in range(5))
    r = fb.admit(both, 1_000)
    assert not r.allowed and r.denied_by == 1 and r.retry_after_ms == 9_000
    # the window denied, so the bucket was not debited: a bucket-only request still has no tokens left (5 used)
    assert not fb.admit([rule_item(READ, "u", 1)], 1_000).allowed


def test_local_state_is_bounded():
    fb = LocalAllowances(max_keys=3)
    for i in range(10):
        fb.admit([rule_item(READ, f"k{i}", 1)], 1_000)
    assert len(fb) == 3


def test_the_fallback_bucket_charges_the_rule_cost_times_the_cost_hint():
    fb = LocalAllowances()
    assert fb.admit([rule_item(READ, "k", 3)], 0).remaining == (2,)  # 5 tokens, 3 x 1,000 millitokens
    assert not fb.admit([rule_item(READ, "k", 3)], 0).allowed


# --- a pool's allowance --------------------------------------------------------------------------
def test_pool_allowance_counts_per_allocator_window():
    a = LocalAllowances()
    assert [pool(a, "p", win(7), 1, 3).allowed for _ in range(4)] == [True, True, True, False]
    denied = pool(a, "p", win(7, end=120), 1, 3)
    assert (denied.allowed, denied.remaining, denied.retry_after_ms) == (False, (0,), 120)
    assert pool(a, "p", win(8), 3, 3).allowed  # the next window starts full
    assert pool(a, "other", win(7), 1, 3).allowed  # per pool


def test_an_uncertain_decision_is_charged_to_both_windows():
    a = LocalAllowances()
    assert pool(a, "p", win(7), 2, 3).allowed
    r = pool(a, "p", win(7, 8), 1, 3)  # near the boundary: 7 or 8
    assert r.allowed and r.remaining == (0,)
    assert a.used("p", 7) == 3 and a.used("p", 8) == 1
    assert not pool(a, "p", win(7, 8), 1, 3).allowed  # window 7 is full
    assert pool(a, "p", win(8), 2, 3).allowed and not pool(a, "p", win(8), 1, 3).allowed


def test_pool_allowances_are_never_evicted_and_old_windows_dropped():
    a = LocalAllowances(max_keys=3)
    for _ in range(3):
        pool(a, "p", win(7), 1, 3)
    for i in range(1_000):  # many other states: nothing pushes window 7 out
        pool(a, f"q{i}", win(7), 1, 3)
        a.admit([rule_item(READ, f"k{i}", 1)], 1_000)
    assert not pool(a, "p", win(7), 1, 3).allowed
    pool(a, "p", win(20), 1, 3)
    assert a.used("p", 7) == 0  # long past: dropped


def test_cost_above_the_allowance_and_a_clock_too_uncertain_deny():
    a = LocalAllowances()
    assert pool(a, "p", win(1), 4, 3).retry_after_ms == -1
    assert pool_item("p", win(1, 9), 1, 3, 60_000) is None  # 9 candidate windows: cannot count per window


def test_a_pool_allowance_and_a_rule_bucket_are_all_or_nothing():
    a = LocalAllowances()
    p = pool_item("p", win(7), 1, 10, 60_000)
    assert p is not None
    for _ in range(5):
        assert a.admit([p, rule_item(READ, "u", 1)], 1_000).allowed
    r = a.admit([p, rule_item(READ, "u", 1)], 1_000)  # the bucket is empty: the pool is not charged
    assert not r.allowed and r.denied_by == 2
    assert a.used("p", 7) == 5
