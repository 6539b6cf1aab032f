"""Negative cache (docs/invariants.md I10): after a denial, the agent denies the same key and cost
locally for min(retry hint, 250 ms), so a flood against an exhausted key stays off the shard.

Bounded (I10): at most ``max_entries`` entries; expired entries are dropped on access and
the oldest are evicted first. Pure: the clock is passed in (monotonic ms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernel.bounded import LRU


@dataclass(frozen=True, slots=True)
class CachedDenial:
    until_ms: float  # deny locally until then
    retry_at_ms: float  # when the original hint said to come back
    payload: Any  # what the engine needs to rebuild the decision


class NegativeCache:
    def __init__(self, max_entries: int = 100_000, cap_ms: int = 250):
        self.max_entries = max_entries
        self.cap_ms = cap_ms
        self._d: LRU[tuple, CachedDenial] = LRU(max_entries)

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: tuple, now_ms: float) -> CachedDenial | None:
        hit = self._d.get(key)
        if hit is None:
            return None
        if now_ms >= hit.until_ms:
            self._d.pop(key)
            return None
        return hit

    def put(self, key: tuple, now_ms: float, retry_ms: int, payload: Any) -> None:
        if retry_ms <= 0 or self.cap_ms <= 0:
            return  # no time-based hint (never / concurrency): nothing to cache
        self._d.put(key, CachedDenial(now_ms + min(retry_ms, self.cap_ms), now_ms + retry_ms, payload))
