"""Negative cache (docs/invariants.md I10): after a denial, the agent denies the same key and cost
locally until the denial's retry time, so a flood against an exhausted key stays off the shard.

How long depends on whether the hint is *exact*. A bucket's or a window's hint (token bucket,
GCRA, fixed/sliding windows) is the first instant the same cost can pass: only time adds tokens
(a denied multi-rule call charged nothing, and the key includes the script arguments, so another
cost or a changed rule asks the store), so the cache holds the denial for the whole hint (at most
``EXACT_MAX_MS``). An exhausted leased pool's hint (tokens may go back to the window) or a
fallback allowance's (the store may come back) is not: those are held ``cap_ms`` at most (250 ms
by default). A leased pool whose balance is empty while its pool is not exhausted is not
remembered at all (region_agent.decision.outcome): its top-up may land any moment.
When a hold ends, one caller probes the store while the others keep the denial (``PROBE_MS``); a
probe that is denied again renews the hold, one that is admitted clears it, and the attempts in
flight then ask the store until one of them is denied. A hot key thus costs one store call per
retry interval plus, per admission, the attempts in flight at that moment (bench figure 5) — not
a number that grows with the attempt rate.

Bounded (I10): at most ``max_entries`` entries; expired entries are dropped on access and
the oldest are evicted first. Pure: the clock is passed in (monotonic ms)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kernel.caches import LRU


@dataclass(frozen=True, slots=True)
class CachedDenial:
    until_ms: float  # deny locally until then
    retry_at_ms: float  # when the original hint said to come back
    payload: Any  # what the engine needs to rebuild the decision


EXACT_MAX_MS = 60_000  # an exact hint longer than this (a long fixed window) is asked again after it
PROBE_MS = 50  # while one caller asks the store again, the others keep the denial this long at most


# what a denial is held for: a whole call's slots (tuple of Call) or one slot's (key, params)
DenialKey = tuple[object, ...]


def denial_keys(calls: Sequence[Any]) -> tuple[DenialKey, ...]:
    """What a held denial of a multi-rule call's slots ``calls`` (region_agent.decision.call.Call:
    key, kind, params) is found by, in the order region_agent.decision.denials asks: the whole
    call's slots, then each slot's (key, params). A plan carries its question's, built once
    (region_agent.decision.plan.Keyed)."""
    if not calls:
        return ()
    return (tuple(calls), *((c.key, c.params) for c in calls))


class NegativeCache:
    def __init__(self, max_entries: int = 100_000, cap_ms: int = 250):
        self.max_entries = max_entries
        self.cap_ms = cap_ms
        self._d: LRU[DenialKey, CachedDenial] = LRU(max_entries)
        # the held denials by key, read-only: the engine tests membership before it calls a method
        # (most requests meet no held denial)
        self.entries = self._d.entries

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: DenialKey, now_ms: float) -> CachedDenial | None:
        """The cached denial of ``key``, or None: ask the store. When a denial's hold is over, one
        caller (the probe) is let through and the others keep the denial for ``PROBE_MS`` more,
        until the probe's answer replaces it (:meth:`put`) or removes it (:meth:`forget`): a
        flood of concurrent attempts sends one call to the store per retry interval, not one
        per attempt in flight at that instant."""
        hit = self._d.get(key)
        if hit is None:
            return None
        if now_ms >= hit.until_ms:  # this caller probes (the entry stays, bounded by max_entries)
            self._d.put(key, CachedDenial(now_ms + PROBE_MS, hit.retry_at_ms, hit.payload))
            return None
        return hit

    def forget(self, key: DenialKey) -> None:
        """The store admitted a call on ``key``: the denial no longer holds."""
        self._d.pop(key, None)

    def put(self, key: DenialKey, now_ms: float, retry_ms: int, payload: Any, *, exact: bool = False) -> None:
        """Remember a denial of ``key`` with hint ``retry_ms``; ``exact``: nothing but time can make
        the same call pass before the hint (see the module docstring). ``cap_ms`` 0 disables."""
        if retry_ms <= 0 or self.cap_ms <= 0:
            return  # no time-based hint (never / concurrency): nothing to cache
        hold = min(retry_ms, EXACT_MAX_MS if exact else self.cap_ms)
        self._d.put(key, CachedDenial(now_ms + hold, now_ms + retry_ms, payload))
