"""Bounded in-process fallback allowances (failMode ``local_bounded``, seed ch. 10).

Used only while the store is unreachable. Each rule's ``fallback`` parameters define a
small local token bucket (millitokens) or fixed window per key; at most ``max_keys`` states
are kept (least recently used evicted, which can only make a local bucket fuller, bounded
by its capacity). All rules of one request are checked before any is debited.
Pure: the wall/monotonic clock in ms is passed in.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kernel.bundle import Fallback, Rule

from .algorithms import fixed_window, token_bucket


@dataclass(frozen=True, slots=True)
class LocalItem:
    key: str
    rule: Rule
    cost_hint: int
    window: tuple[int, int] | None = None  # (limit, windowMs) for a pool rule's per-agent allowance


@dataclass(frozen=True, slots=True)
class LocalResult:
    allowed: bool
    denied_by: int  # 1-based index into the items, 0 = none
    retry_after_ms: int
    remaining: tuple[int, ...]  # whole tokens / requests per item


class LocalFallback:
    """A bounded LRU of local states; the arithmetic is the reference models' (the same integer
    rules as the Lua scripts): a token bucket when the fallback has ``capacityMillis``, else a
    fixed window."""

    def __init__(self, max_keys: int = 100_000):
        self.max_keys = max_keys
        self._state: OrderedDict[str, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._state)

    @staticmethod
    def _model(it: LocalItem):
        if it.window is not None:  # a global pool's per-agent allowance while Redis is unreachable
            limit, window_ms = it.window
            return fixed_window.decide, fixed_window.WindowParams(limit, window_ms, it.rule.cost * it.cost_hint), 1
        fb: Fallback | None = it.rule.fallback
        assert fb is not None, "local_bounded rules carry fallback parameters (bundle validation)"
        if fb.capacity_millis is not None:
            cost = (it.rule.cost_millis or 1000) * it.cost_hint
            params = token_bucket.TokenBucketParams(fb.capacity_millis, fb.refill_millis or 1, fb.period_ms or 1,
                                                    cost)
            return token_bucket.decide, params, 1000
        params = fixed_window.WindowParams(fb.limit or 1, fb.window_ms or 1, it.cost_hint)
        return fixed_window.decide, params, 1

    def admit(self, items: list[LocalItem], now_ms: int) -> LocalResult:
        now = int(now_ms)
        news: list[tuple[str, Any]] = []
        remaining: list[int] = []
        denied_by, retry = 0, 0
        for i, it in enumerate(items, start=1):
            key = it.rule.id + "\x1f" + it.key
            decide, params, unit = self._model(it)
            d, new = decide(self._state.get(key), params, now)
            remaining.append(max(0, d.remaining) // unit)
            news.append((key, new))
            if not d.allowed:
                denied_by = denied_by or i
                retry = -1 if (retry < 0 or d.retry_after_ms < 0) else max(retry, d.retry_after_ms)
        if denied_by:
            return LocalResult(False, denied_by, retry, tuple(remaining))
        for key, new in news:  # all allowed: commit every state
            self._state[key] = new
            self._state.move_to_end(key)
        while len(self._state) > self.max_keys:
            self._state.popitem(last=False)
        return LocalResult(True, 0, 0, tuple(remaining))
