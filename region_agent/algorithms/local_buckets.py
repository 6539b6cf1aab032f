"""In-process limiter states for the agent's local fallback allowance: a bounded LRU of model
states keyed by (rule id, key). Pure: the caller passes the clock."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from . import fixed_window, gcra, sliding_counter, token_bucket
from .common import Decision


class LocalBuckets:
    """At most ``max_size`` states; the least recently used is evicted (an evicted bucket comes
    back full, so size the cache for the keys a fallback period can touch)."""

    def __init__(self, max_size: int = 10_000):
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self.max_size = max_size
        self._states: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def state(self, rule_id: str, key: str) -> Any:
        return self._states.get((rule_id, key))

    def decide(self, rule_id: str, key: str, params: Any, now_ms: int, *, algorithm: str = "tb") -> Decision:
        """Run one rule locally. ``algorithm``: "tb" | "gcra" (TokenBucketParams) or "fw" | "sc"
        (WindowParams). The state is only changed when the request is allowed."""
        k = (rule_id, key)
        st = self._states.get(k)
        if algorithm == "tb":
            d, new = token_bucket.decide(st, params, now_ms)
        elif algorithm == "gcra":
            d, new = gcra.decide(st, params, now_ms)
        elif algorithm == "fw":
            d, new = fixed_window.decide(st, params, now_ms)
        elif algorithm == "sc":
            d, new = sliding_counter.decide(st, params, now_ms)
        else:
            raise ValueError(f"no local fallback for algorithm {algorithm!r}")
        if new is not None:
            self._states[k] = new
        if k in self._states:
            self._states.move_to_end(k)
        while len(self._states) > self.max_size:
            self._states.popitem(last=False)
        return d

    def clear(self) -> None:
        self._states.clear()
