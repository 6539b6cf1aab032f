"""Waiting for a condition instead of sleeping a fixed time (docs/testing.md, "Tests on a noisy
machine"). Both return the predicate's first truthy value, or its last value when ``within_s``
passes; the caller asserts it, with its own message::

    assert wait_until(lambda: proc.ready()), proc.tail()
    assert await await_until(store_flagged, within_s=15)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_until(pred: Callable[[], Any], within_s: float = 20.0, interval: float = 0.1) -> Any:
    """Call ``pred`` every ``interval`` seconds until it returns a truthy value or ``within_s`` pass."""
    deadline = time.monotonic() + within_s
    while True:
        got = pred()
        if got or time.monotonic() >= deadline:
            return got
        time.sleep(interval)


async def await_until(pred: Callable[[], Any], within_s: float = 20.0, interval: float = 0.05) -> Any:
    """:func:`wait_until` on the event loop; ``pred`` may be a coroutine function."""
    deadline = time.monotonic() + within_s
    while True:
        got = pred()
        if inspect.isawaitable(got):
            got = await got
        if got or time.monotonic() >= deadline:
            return got
        await asyncio.sleep(interval)
