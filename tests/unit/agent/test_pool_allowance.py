"""The in-process pool allowance while Redis is unreachable (issue 11 paths 4 and 5): counted per
allocator window, every candidate window charged, never evicted within its window."""

from region_agent.leasing.window_clock import Windows
from region_agent.pool_allowance import PoolWindowAllowance


def win(lo: int, hi: int | None = None, end: int = 500) -> Windows:
    return Windows(lo, lo if hi is None else hi, end, end)


def test_counts_per_allocator_window():
    a = PoolWindowAllowance()
    assert [a.admit("p", win(7), 1, 3).allowed for _ in range(4)] == [True, True, True, False]
    denied = a.admit("p", win(7, end=120), 1, 3)
    assert (denied.allowed, denied.remaining, denied.retry_after_ms) == (False, 0, 120)
    assert a.admit("p", win(8), 3, 3).allowed  # the next window starts full
    assert a.admit("other", win(7), 1, 3).allowed  # per pool


def test_an_uncertain_decision_is_charged_to_both_windows():
    a = PoolWindowAllowance()
    assert a.admit("p", win(7), 2, 3).allowed
    r = a.admit("p", win(7, 8), 1, 3)  # near the boundary: 7 or 8
    assert r.allowed and r.remaining == 0
    assert a.used("p", 7) == 3 and a.used("p", 8) == 1
    assert not a.admit("p", win(7, 8), 1, 3).allowed  # window 7 is full
    assert a.admit("p", win(8), 2, 3).allowed and not a.admit("p", win(8), 1, 3).allowed


def test_never_evicted_while_current_and_old_windows_dropped():
    a = PoolWindowAllowance()
    for _ in range(3):
        a.admit("p", win(7), 1, 3)
    for i in range(10_000):  # many other pools' states: nothing pushes window 7 out
        a.admit(f"q{i}", win(7), 1, 3)
    assert not a.admit("p", win(7), 1, 3).allowed
    a.admit("p", win(20), 1, 3)
    assert a.used("p", 7) == 0  # long past: dropped


def test_cost_above_the_allowance_and_a_clock_too_uncertain_deny():
    a = PoolWindowAllowance()
    assert a.admit("p", win(1), 4, 3).retry_after_ms == -1
    assert not a.admit("p", win(1, 9), 1, 3).allowed  # 9 candidate windows: cannot count per window
    assert not a.admit("p", win(1), 1, 0).allowed
