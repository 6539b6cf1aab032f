"""The in-process part of a pool's fallback allowance: what this agent admits for a pool while
its regional Redis is unreachable, ``fallbackPerRegion`` tokens per pool window as the allocator
numbers it (DESIGN invariant 6; the window candidates come from
:class:`region_agent.leasing.window_clock.AllocatorClock`).

One counter per (pool, allocator window); a decision is charged to every candidate window. Unlike
the per-rule fallback buckets (an LRU), these counters are never evicted while their window may
still be current — an evicted, exhausted allowance would come back full inside the same window.
They are few: one per pool and window, and windows more than ``KEEP`` before the earliest
candidate are dropped. Pure: the caller passes the candidate windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .algorithms.pool_window import KEEP, MAX_SPAN
from .leasing.window_clock import Windows


@dataclass(frozen=True, slots=True)
class AllowanceResult:
    allowed: bool
    remaining: int  # tokens left in the most used candidate window
    retry_after_ms: int  # 0 when allowed; -1 = the cost exceeds the allowance


class PoolWindowAllowance:
    def __init__(self) -> None:
        self._used: dict[str, dict[int, int]] = {}

    def used(self, pool_id: str, window: int) -> int:
        return self._used.get(pool_id, {}).get(window, 0)

    def check(self, pool_id: str, windows: Windows, cost: int, limit: int) -> AllowanceResult:
        """Would ``cost`` fit in every candidate window? (Nothing is counted.)"""
        if cost > limit or limit <= 0:
            return AllowanceResult(False, max(0, limit), -1)
        used = self._used.setdefault(pool_id, {})
        for k in [k for k in used if k < windows.lo - KEEP]:
            del used[k]
        if windows.span > MAX_SPAN:  # the allocator's clock is too uncertain to count per window
            return AllowanceResult(False, 0, windows.end_in_ms)
        room = min(limit - used.get(k, 0) for k in range(windows.lo, windows.hi + 1))
        if room < cost:
            return AllowanceResult(False, max(0, room), windows.end_in_ms)
        return AllowanceResult(True, room - cost, 0)

    def commit(self, pool_id: str, windows: Windows, cost: int) -> None:
        used = self._used.setdefault(pool_id, {})
        for k in range(windows.lo, windows.hi + 1):
            used[k] = used.get(k, 0) + cost

    def admit(self, pool_id: str, windows: Windows, cost: int, limit: int) -> AllowanceResult:
        res = self.check(pool_id, windows, cost, limit)
        if res.allowed:
            self.commit(pool_id, windows, cost)
        return res
