"""Placing a real-time test inside one Unix-time-aligned window (window ``k`` covers wall-clock
``[k*W, (k+1)*W)``, as the allocator and the fixed-window scripts number them).

A scenario that must stay in one window waits, when it is less than ``after_ms`` into the current
window or less than ``before_ms`` from its end, until ``after_ms`` into the next one."""

from __future__ import annotations

import asyncio
import time


def edge_wait_s(window_ms: int, before_ms: int, after_ms: int = 0, now_ms: float | None = None) -> float:
    """Seconds to wait from ``now_ms`` (default: the wall clock) to be clear of the window's edges."""
    pos = (time.time() * 1000 if now_ms is None else now_ms) % window_ms
    if pos < after_ms:
        return (after_ms - pos) / 1000
    if window_ms - pos < before_ms:
        return (window_ms - pos + after_ms) / 1000 + 0.05
    return 0.0


async def clear_of_window_edges(window_ms: int, before_ms: int, after_ms: int = 0) -> None:
    await asyncio.sleep(edge_wait_s(window_ms, before_ms, after_ms))


def clear_of_window_edges_sync(window_ms: int, before_ms: int, after_ms: int = 0) -> None:
    time.sleep(edge_wait_s(window_ms, before_ms, after_ms))
