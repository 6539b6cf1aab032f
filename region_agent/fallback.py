"""Bounded in-process fallback allowances (failMode ``local_bounded``, seed ch. 10).

Used only while the store is unreachable. Each rule's ``fallback`` parameters define a
small local token bucket (millitokens) or fixed window per key; at most ``max_keys`` states
are kept (least recently used evicted, which can only make a local bucket fuller, bounded
by its capacity). All rules of one request are checked before any is debited.
Pure: the wall/monotonic clock in ms is passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from allocator.contract.bundle import Fallback, Rule


@dataclass(frozen=True, slots=True)
class LocalItem:
    key: str
    rule: Rule
    cost_hint: int


@dataclass(frozen=True, slots=True)
class LocalResult:
    allowed: bool
    denied_by: int  # 1-based index into the items, 0 = none
    retry_after_ms: int
    remaining: tuple[int, ...]  # whole tokens / requests per item


class _Bucket:
    __slots__ = ("tokens", "ts")

    def __init__(self, tokens: int, ts: int):
        self.tokens, self.ts = tokens, ts


class LocalFallback:
    def __init__(self, max_keys: int = 100_000):
        self.max_keys = max_keys
        self._state: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._state)

    def _get(self, key: str, full: int, now: int) -> _Bucket:
        st = self._state.get(key)
        if st is None:
            st = _Bucket(full, now)
            self._state[key] = st
            while len(self._state) > self.max_keys:
                self._state.popitem(last=False)
        else:
            self._state.move_to_end(key)
        return st

    @staticmethod
    def _bucket_view(fb: Fallback, st: _Bucket, now: int) -> int:
        cap, refill, period = fb.capacity_millis or 0, fb.refill_millis or 1, fb.period_ms or 1
        full_ms = math.ceil(cap * period / refill)
        delta = min(max(0, now - st.ts), full_ms)
        return min(cap, st.tokens + (delta * refill) // period)

    def admit(self, items: list[LocalItem], now_ms: int) -> LocalResult:
        now = int(now_ms)
        plans: list[tuple[str, _Bucket, int, int, int]] = []  # key, state, value-after-refill, cost, window
        denied_by, retry = 0, 0
        remaining: list[int] = []
        for i, it in enumerate(items, start=1):
            fb = it.rule.fallback
            assert fb is not None, "local_bounded rules carry fallback parameters (bundle validation)"
            key = "fb:" + it.rule.id + ":" + it.key
            if fb.capacity_millis is not None:
                cost = (it.rule.cost_millis or 1000) * it.cost_hint
                st = self._get(key, fb.capacity_millis, now)
                tokens = self._bucket_view(fb, st, now)
                plans.append((key, st, tokens, cost, 0))
                remaining.append(tokens // 1000)
                if tokens < cost:
                    denied_by = denied_by or i
                    if cost > fb.capacity_millis:
                        retry = -1 if retry >= 0 else retry
                    elif retry >= 0:
                        retry = max(retry, math.ceil((cost - tokens) * (fb.period_ms or 1) / (fb.refill_millis or 1)))
            else:
                window = fb.window_ms or 1
                start = now - now % window
                st = self._get(key, 0, start)
                count = st.tokens if st.ts == start else 0
                plans.append((key, st, count, it.cost_hint, start))
                limit = fb.limit or 0
                remaining.append(max(0, limit - count))
                if count + it.cost_hint > limit:
                    denied_by = denied_by or i
                    if it.cost_hint > limit:
                        retry = -1 if retry >= 0 else retry
                    elif retry >= 0:
                        retry = max(retry, start + window - now)
        if denied_by:
            return LocalResult(False, denied_by, retry, tuple(remaining))
        out: list[int] = []
        for (_key, st, value, cost, window_start), it in zip(plans, items, strict=True):
            if it.rule.fallback and it.rule.fallback.capacity_millis is not None:
                st.tokens, st.ts = value - cost, max(st.ts, now)
                out.append(st.tokens // 1000)
            else:
                st.tokens, st.ts = value + cost, window_start
                out.append(max(0, (it.rule.fallback.limit or 0) - st.tokens))  # type: ignore[union-attr]
        return LocalResult(True, 0, 0, tuple(out))
