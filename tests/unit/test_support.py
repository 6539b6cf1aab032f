"""The shared test helpers of tests/support behave as their callers assume."""

from __future__ import annotations

import itertools
from pathlib import Path

from kernel.bundle import load_bundle_file
from tests.support.clock import FakeClock
from tests.support.policies import northstar, northstar_file
from tests.support.waiting import await_until, wait_until
from tests.support.windows import edge_wait_s, window_start_wait_s


def test_the_fake_clock_moves_only_when_told() -> None:
    c = FakeClock(5.0)
    assert c() == 5.0 and c() == 5.0
    assert c.advance(0.5) == 5.5 and c() == 5.5
    c.t = 100.0
    assert c() == 100.0 and FakeClock()() == 1_000.0


def test_waiting_returns_the_first_truthy_value_or_the_last_one() -> None:
    n = itertools.count()
    assert wait_until(lambda: next(n) >= 3 and "done", within_s=5, interval=0.001) == "done"
    assert wait_until(lambda: 0, within_s=0.01, interval=0.001) == 0  # the caller's assert fails


async def test_awaiting_takes_plain_and_coroutine_predicates() -> None:
    n = itertools.count()

    async def ready() -> bool:
        return next(n) >= 2

    assert await await_until(ready, within_s=5, interval=0.001) is True
    assert await await_until(lambda: None, within_s=0.01, interval=0.001) is None


def test_the_policy_file_is_the_sample_bundle(tmp_path: Path) -> None:
    path = northstar_file(tmp_path)
    assert path == tmp_path / "bundle.json" and load_bundle_file(str(path)) == northstar()


W = 60_000


def test_inside_the_window_there_is_no_edge_wait() -> None:
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 1_500) == 0.0
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 45_000) == 0.0


def test_in_the_tail_the_edge_wait_goes_into_the_next_window() -> None:
    wait = edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 50_000)
    assert 5 * W + 50_000 + wait * 1000 >= 6 * W + 1_500
    assert wait < 12  # not a window more
    # with no after_ms: just past the boundary (the gateways' "at least before_ms of the window left")
    assert edge_wait_s(10_000, before_ms=5_000, now_ms=7 * 10_000 + 6_000) == 4.05


def test_at_the_start_the_edge_wait_waits_for_after_ms() -> None:
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 500) == 1.0
    assert edge_wait_s(W, before_ms=15_000, now_ms=5 * W) == 0.0


def test_a_window_start_is_always_the_next_one() -> None:
    assert window_start_wait_s(W, after_ms=200, now_ms=5 * W + 45_000) == (6, 15.2)
    # early in a window, where edge_wait_s would not wait at all, it still waits for the next one
    assert window_start_wait_s(W, after_ms=200, now_ms=5 * W + 1_500) == (6, 58.7)
    assert window_start_wait_s(W, after_ms=0, now_ms=5 * W) == (6, 60.0)
