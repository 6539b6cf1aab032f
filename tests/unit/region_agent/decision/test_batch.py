"""region_agent.decision.batch: a batch's calls in one submit, the replies sliced back per item."""

from __future__ import annotations

from kernel.errors import ScriptRejected, StoreUnavailable
from region_agent.decision.batch import BATCH_ITEMS_PER_BUDGET, BatchCalls, batch_budget_s


def call(name: str):
    return ("multi_rule", [name], [])


def test_each_item_gets_its_own_replies_in_order():
    b = BatchCalls()
    assert b.add([call("a1"), call("a2")]) == 0  # enforced + shadow call
    assert b.add([]) == 1  # decided before the store
    assert b.add([call("c1")]) == 2
    assert [c[1][0] for c in b.calls] == ["a1", "a2", "c1"]
    replies = ["ra1", "ra2", "rc1"]
    assert (b.replies(0, replies), b.replies(1, replies), b.replies(2, replies)) == (["ra1", "ra2"], [], ["rc1"])


def test_an_item_whose_calls_could_not_be_built_gets_its_error_and_sends_nothing():
    b = BatchCalls()
    err = ScriptRejected("nine slots")
    b.add([call("a")])
    b.add(err)
    b.add([call("c")])
    assert len(b.calls) == 2
    assert b.replies(1, ["ra", "rc"]) is err and b.replies(2, ["ra", "rc"]) == ["rc"]


def test_a_failed_submit_is_every_items_error():
    b = BatchCalls()
    b.add([call("a")])
    b.add([call("b")])
    down = StoreUnavailable("down")
    assert b.replies(0, down) is down and b.replies(1, down) is down


def test_a_batch_gets_one_more_budget_per_block_of_items():
    assert batch_budget_s(0.05, 1) == 0.05
    assert batch_budget_s(0.05, BATCH_ITEMS_PER_BUDGET - 1) == 0.05
    assert batch_budget_s(0.05, BATCH_ITEMS_PER_BUDGET) == 0.1
    assert batch_budget_s(0.05, 1000) == 0.05 * (1 + 1000 // BATCH_ITEMS_PER_BUDGET)
