"""Placing a real-time test in Unix-time-aligned windows (window ``k`` covers wall-clock
``[k*W, (k+1)*W)``, as the allocator and the fixed-window scripts number them; docs/testing.md,
"Tests on a noisy machine"). Two different waits, on purpose:

- :func:`clear_of_window_edges` (and ``_sync``): a scenario that must stay in one window waits only
  when it is less than ``after_ms`` into the current window or less than ``before_ms`` from its end,
  and then until ``after_ms`` into the next one; otherwise it starts at once, in the current window.
- :func:`wait_for_window_start`: a scenario that must start at a known point of a fresh window
  always waits for the next window's start (plus ``after_ms``), however far the current one is from
  its edges, and gets that window's index.
"""

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


def window_start_wait_s(window_ms: int, after_ms: int, now_ms: float | None = None) -> tuple[int, float]:
    """The index of the window after the one ``now_ms`` (default: the wall clock) is in, and the
    seconds from ``now_ms`` to ``after_ms`` into it."""
    now = time.time() * 1000 if now_ms is None else now_ms
    k = int(now // window_ms) + 1
    return k, max(0.0, k * window_ms + after_ms - now) / 1000


async def wait_for_window_start(window_ms: int, after_ms: int = 50) -> int:
    """Sleep until ``after_ms`` into the next window, wherever the current one is; returns its index."""
    k, wait_s = window_start_wait_s(window_ms, after_ms)
    await asyncio.sleep(wait_s)
    return k
