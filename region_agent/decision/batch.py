"""A batch of decisions in one store submit: every item's script calls in one list (one round
trip per shard, region_agent.store.batcher), the replies sliced back to their items.

Pure: the engine builds each item's calls (or the error building them raised), submits
:attr:`BatchCalls.calls` once and asks :meth:`BatchCalls.replies` for each item's part.
"""

from __future__ import annotations

from typing import Any

from kernel.errors import LeaseholdError

from .call import ScriptCall

BATCH_ITEMS_PER_BUDGET = 64  # a batch gets one more decision budget per this many items


def batch_budget_s(budget_s: float, items: int) -> float:
    """The budget of every item of a batch of ``items`` decisions (they share one submit)."""
    return budget_s * (1 + items // BATCH_ITEMS_PER_BUDGET)


class BatchCalls:
    def __init__(self) -> None:
        self.calls: list[ScriptCall] = []
        self._spans: list[tuple[int, int]] = []  # per item: (first call, number of calls)
        self._failed: dict[int, LeaseholdError] = {}  # items whose calls could not be built

    def add(self, calls: list[ScriptCall] | LeaseholdError) -> int:
        """Add the next item's calls (none: decided without the store), or the error building them
        raised (e.g. a call shape the script would refuse). Returns the item's index."""
        i = len(self._spans)
        if isinstance(calls, LeaseholdError):
            self._failed[i] = calls
            calls = []
        self._spans.append((len(self.calls), len(calls)))
        self.calls.extend(calls)
        return i

    def replies(self, i: int, replies: list[Any] | LeaseholdError) -> list[Any] | LeaseholdError:
        """Item ``i``'s part of the submit's ``replies`` (the submit's error: every item's)."""
        if i in self._failed:
            return self._failed[i]
        if isinstance(replies, LeaseholdError):
            return replies
        start, n = self._spans[i]
        return replies[start:start + n]
