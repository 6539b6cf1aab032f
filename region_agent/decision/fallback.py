"""The in-process allowances that answer while Redis is unreachable (failMode ``local_bounded``).

One local model: a request's local allowances are decided all or nothing by the same step the
scripts take (:func:`kernel.algorithms.multi_rule.decide`, the reference model of
``multi_rule.lua``), over states held here instead of in Redis:

* a rule's ``fallback`` parameters: a token bucket or a fixed window per (rule, key)
  (:meth:`~kernel.algorithms.rule.RuleBase.fallback_call`); at most ``max_keys`` of these states
  are kept, the least recently used evicted (an evicted bucket comes back full, bounded by its
  capacity);
* a pool's allowance: ``fallbackPerRegion`` tokens per pool window as the allocator numbers it,
  charged to every candidate window (kind ``pw``); one state per pool, never evicted — an
  evicted, exhausted allowance would come back full inside the same window (these are few: one
  per pool, and windows more than ``KEEP`` before the earliest candidate are dropped).

Pure: the clock (ms) and the candidate windows are passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kernel.algorithms import multi_rule
from kernel.algorithms.multi_rule import MultiDecision
from kernel.algorithms.pool_window import KIND as POOL_WINDOW
from kernel.algorithms.pool_window import MAX_SPAN
from kernel.algorithms.rule import Params
from kernel.caches import LRU

from ..leasing.window_clock import Windows


class LocalItem(NamedTuple):
    """One allowance a request needs: its state (``key``), its slot (``kind``, ``params``) and the
    units of the slot's ``remaining`` per whole token (``millis``)."""

    key: str
    kind: str
    params: Params
    millis: int = 1
    pooled: bool = False  # a pool's allowance (never evicted); else a rule's fallback state (LRU)
    retry_floor_ms: int = 0  # a denial's hint is at least this (a pool allowance: the window's end)


def rule_item(rule: Any, key: str, cost_hint: int) -> LocalItem:
    """The fallback allowance of ``rule`` for the state key ``key``."""
    kind, params, millis = rule.fallback_call(cost_hint)
    return LocalItem(rule.id + "\x1f" + key, kind, params, millis)


def pool_item(pool_id: str, windows: Windows, tokens: int, limit: int, ttl_ms: int) -> LocalItem | None:
    """``tokens`` of a pool's allowance (``limit`` per allocator window) in every candidate window;
    None when there are too many candidates to count (the allocator's clock is too uncertain)."""
    if windows.span > MAX_SPAN:
        return None
    return LocalItem(pool_id, POOL_WINDOW.code, (limit, windows.lo, windows.hi, tokens, max(1, ttl_ms)), 1,
                     pooled=True, retry_floor_ms=windows.end_in_ms)


class LocalAllowances:
    def __init__(self, max_keys: int = 100_000):
        self.max_keys = max_keys
        self._states: LRU[str, Any] = LRU(max_keys)  # rule fallbacks, least recently written evicted first
        self._pools: dict[str, Any] = {}  # pool allowances

    def __len__(self) -> int:
        return len(self._states)

    def admit(self, items: Sequence[LocalItem], now_ms: int) -> MultiDecision:
        """All of ``items`` or none; ``remaining`` per item in whole tokens."""
        states = [(self._pools if it.pooled else self._states).get(it.key) for it in items]
        d, new = multi_rule.decide(states, items, int(now_ms), "local")
        remaining = tuple(max(0, r) // it.millis for r, it in zip(d.remaining, items, strict=True))
        if new is None:
            floor = items[d.denied_by - 1].retry_floor_ms
            retry = d.retry_after_ms if d.retry_after_ms < 0 else max(d.retry_after_ms, floor)
            return MultiDecision(False, d.denied_by, retry, remaining)
        for it, state in zip(items, new, strict=True):
            if it.pooled:
                self._pools[it.key] = state
            else:
                self._states.put(it.key, state)
        return MultiDecision(True, 0, 0, remaining)

    def used(self, pool_id: str, window: int) -> int:
        """Tokens a pool's allowance admitted in allocator window ``window``."""
        state = self._pools.get(pool_id)
        return state.counts.get(window, 0) if state is not None else 0
