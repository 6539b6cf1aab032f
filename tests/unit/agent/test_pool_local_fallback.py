"""With the regional Redis unreachable, a tenant pool rule spends at most the pool's
fallbackPerRegion per pool window in each agent (the local term of the overshoot bound)."""

from kernel.bundle import Rule
from region_agent.fallback import LocalFallback, LocalItem

RULE = Rule(id="tenant-atlas-global", scope="tenant", tenant="atlas", algorithm="pool", pool="atlas-minute",
            fail_mode="local_bounded")


def test_pool_rule_allowance_is_a_fixed_window_of_the_pool_fallback():
    fb = LocalFallback()
    item = LocalItem("rl:v3:{t:atlas}:pool:atlas-minute", RULE, 1, window=(100, 60_000))
    got = [fb.admit([item], 1_000).allowed for _ in range(101)]
    assert got == [True] * 100 + [False]
    denied = fb.admit([item], 1_000)
    assert denied.retry_after_ms == 59_000  # the rest of the local window
    assert fb.admit([item], 60_000).allowed  # next window: a fresh allowance


def test_cost_hint_multiplies_the_pool_cost():
    fb = LocalFallback()
    item = LocalItem("k", RULE, 30, window=(100, 60_000))
    assert [fb.admit([item], 0).allowed for _ in range(4)] == [True, True, True, False]
