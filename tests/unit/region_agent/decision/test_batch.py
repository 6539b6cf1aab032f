"""region_agent.decision.batch: the budget a batch's items share (how its replies are sliced back
per item: tests/unit/region_agent/decision/test_engine.py, the batch twins)."""

from __future__ import annotations

from region_agent.decision.batch import BATCH_ITEMS_PER_BUDGET, batch_budget_s


def test_a_batch_gets_one_more_budget_per_block_of_items():
    assert batch_budget_s(0.05, 1) == 0.05
    assert batch_budget_s(0.05, BATCH_ITEMS_PER_BUDGET - 1) == 0.05
    assert batch_budget_s(0.05, BATCH_ITEMS_PER_BUDGET) == 0.1
    assert batch_budget_s(0.05, 1000) == 0.05 * (1 + 1000 // BATCH_ITEMS_PER_BUDGET)
