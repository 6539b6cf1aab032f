"""The two bounded caches of the codebase (docs/invariants.md: every cache is bounded).

* :class:`BoundedMemo` — a memo of values that can always be recomputed (resolved metric
  children, derived keys, rule selections, log throttling state). Reads are a plain
  ``dict.get`` (C speed: these are read on every decision); :meth:`BoundedMemo.put` empties the
  memo when it holds ``max_entries`` and a new key comes. The bound is exact: never more than
  ``max_entries`` entries. Dropping everything at once costs a burst of recomputation, never a
  wrong answer, and keeps every read free of bookkeeping.
* :class:`LRU` — state that must survive for the keys in use (local fallback buckets, cached
  denials): at most ``max_entries`` entries, the least recently *written* is evicted first.
  Reads do not reorder (a read-mostly key that is never written again is old by definition).

Why not ``cachetools``: its caches do Python-level bookkeeping on every read (an ``LRUCache``
hit reorders, ``Cache.__getitem__`` is a Python method) where the memos here are read on every
decision, and its ``TTLCache`` reads a clock itself where the domain code is given its clock.
Both classes here are a few lines over ``dict`` / ``OrderedDict``; ``BoundedMemo.get`` is the
inherited C ``dict.get``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, ItemsView, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMemo(dict[K, V]):
    """A dict of at most ``max_entries`` entries that empties itself when full (module doc).
    Write through :meth:`put` or :meth:`get_or_put`; ``memo[k] = v`` is not bounded."""

    __slots__ = ("max_entries",)

    def __init__(self, max_entries: int):
        super().__init__()
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries

    def put(self, key: K, value: V) -> V:
        if len(self) >= self.max_entries and key not in self:
            self.clear()
        self[key] = value
        return value

    def get_or_put(self, key: K, make: Callable[[], V]) -> V:
        """The memoised value of ``key``, computed by ``make()`` on a miss."""
        hit = self.get(key)
        if hit is None:
            return self.put(key, make())
        return hit


class LRU(Generic[K, V]):
    """At most ``max_entries`` entries; a write makes its key the newest; the oldest written key
    is evicted first."""

    __slots__ = ("_d", "entries", "max_entries")

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._d: OrderedDict[K, V] = OrderedDict()
        # the entries, read-only: a hot path's membership test without a method call
        self.entries: Mapping[K, V] = self._d

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def get(self, key: K, default: V | None = None) -> V | None:
        return self._d.get(key, default)

    def put(self, key: K, value: V) -> None:
        d = self._d
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def pop(self, key: K, default: V | None = None) -> V | None:
        return self._d.pop(key, default)

    def clear(self) -> None:
        self._d.clear()

    def items(self) -> ItemsView[K, V]:
        return self._d.items()


__all__ = ["LRU", "BoundedMemo"]
