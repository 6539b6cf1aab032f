"""region_agent.store.lag: how late the event loop runs its ticks (the agent's own saturation)."""

from __future__ import annotations

import asyncio

import pytest

from region_agent.store.lag import LoopLag
from tests.support.clock import FakeClock


def test_ticks_on_time_mean_no_lag():
    c = FakeClock(100.0)
    lag = LoopLag(interval_s=0.005, window_s=0.5, clock=c)
    for _ in range(10):
        c.t += 0.005
        lag.tick(c.t)
    assert lag.lag_s(c.t) == 0.0


def test_the_worst_lateness_is_kept_for_the_window_then_forgotten():
    c = FakeClock(100.0)
    lag = LoopLag(interval_s=0.005, window_s=0.5, clock=c)
    c.t += 0.105  # 100 ms late
    lag.tick(c.t)
    late_at = c.t
    c.t += 0.005
    lag.tick(c.t)  # on time: the earlier worse lateness still stands
    assert lag.lag_s(c.t) == pytest.approx(0.1)
    assert lag.lag_s(late_at + 0.5) == pytest.approx(0.1)
    assert lag.lag_s(late_at + 0.501) == 0.0


def test_a_later_worse_tick_replaces_milder_ones():
    c = FakeClock(100.0)
    lag = LoopLag(interval_s=0.005, window_s=0.5, clock=c)
    c.t += 0.025
    lag.tick(c.t)  # 20 ms late
    c.t += 0.055
    lag.tick(c.t)  # 50 ms late
    assert lag.lag_s(c.t) == pytest.approx(0.05)
    assert len(lag._worst) == 1  # the milder one can never be the worst again: dropped (bounded list)


def test_an_overdue_tick_counts_only_while_the_monitor_runs():
    c = FakeClock(100.0)
    lag = LoopLag(interval_s=0.005, window_s=0.5, clock=c)
    c.t += 0.305  # the next tick is 300 ms overdue and has not run (a saturated loop)
    assert lag.lag_s(c.t) == 0.0  # not running: nothing can be overdue
    lag.running = True
    assert lag.lag_s(c.t) == pytest.approx(0.3)


async def test_run_marks_itself_running_and_ticks_until_cancelled():
    lag = LoopLag(interval_s=0.001, window_s=0.5)
    task = asyncio.ensure_future(lag.run())
    await asyncio.sleep(0.02)
    assert lag.running and lag._worst  # it ticked
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not lag.running
