"""The load loops' shared parts (chaos/load.py): the workers' pacing is bounded by the shared
budget, the deadline and the stop, and a failing worker ends the others."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from chaos.load import paced, run_workers


async def _count(budget: list[int], *, deadline_s: float = 60.0, stopped=lambda: False) -> int:
    n = 0
    async for _ in paced(1e-6, time.monotonic() + deadline_s, budget, random.Random(0), stopped):
        n += 1
    return n


async def test_paced_stops_when_the_shared_budget_is_spent() -> None:
    budget = [5]
    assert await _count(budget) + await _count(budget) == 5
    assert budget == [0]


async def test_paced_gives_nothing_past_the_deadline_or_once_stopped() -> None:
    assert await _count([5], deadline_s=-1.0) == 0
    assert await _count([5], stopped=lambda: True) == 0
    seen: list[int] = []
    budget = [100]
    async for _ in paced(1e-6, time.monotonic() + 60, budget, random.Random(0), lambda: len(seen) >= 3):
        seen.append(budget[0])
    assert seen == [99, 98, 97]


async def test_a_failing_worker_cancels_the_others() -> None:
    other_cancelled = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            other_cancelled.set()
            raise

    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await run_workers([waits(), fails()])
    assert other_cancelled.is_set()
