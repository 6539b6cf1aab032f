"""The shared test helpers of tests/support behave as their callers assume."""

from __future__ import annotations

import itertools
from pathlib import Path

from kernel.bundle import load_bundle_file
from tests.support.clock import FakeClock
from tests.support.policies import northstar, northstar_file
from tests.support.waiting import await_until, wait_until


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
