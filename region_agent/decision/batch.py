"""A batch of decisions in one store submit (every item's script calls in one list, one round
trip per shard, region_agent.store.batcher; the replies sliced back to their items where the
engine builds them: ``DecisionEngine._decide_plans``): the budget its items share."""

from __future__ import annotations

BATCH_ITEMS_PER_BUDGET = 64  # a batch gets one more decision budget per this many items


def batch_budget_s(budget_s: float, items: int) -> float:
    """The budget of every item of a batch of ``items`` decisions (they share one submit)."""
    return budget_s * (1 + items // BATCH_ITEMS_PER_BUDGET)
