"""The committer's queue and answers (allocator.committer): what an item shows the grouping, and a
caller's one wait settled with the last of its items (joiners with the item they joined), the
writes of a shard counted open until answered, a queued grant findable for a retry until answered."""

import asyncio
from typing import Literal

from allocator.committer import Committer, Item, OpenWrites, ReportItem, Wait
from kernel.errors import Unavailable
from kernel.wire import LeaseRequest, UsageReport


async def _nothing(unit) -> None:  # never called: the committer task is not started
    raise AssertionError("no unit runs in these tests")


def _committer() -> Committer:
    return Committer(_nothing, OpenWrites(), lambda: 128)


def _grant(lease: str, window: Literal["current", "next"] = "current") -> LeaseRequest:
    return LeaseRequest(lease_id=lease, region="eu", pool="p1", want=5, window=window)


async def test_an_item_shows_its_window_choice_a_report_none():
    wait = Wait()
    assert Item(_grant("a"), wait, 0, 7).window_choice == "current"
    assert Item(_grant("b", "next"), wait, 0, 7).window_choice == "next"
    report = ReportItem(UsageReport(lease_id="a", region="eu", pool="p1", spent=1), wait, 0, 7)
    assert report.window_choice == ""  # a report shares no window compare with a grant
    assert wait.open == 3


async def test_one_wait_is_settled_by_the_last_answer_and_a_joiner_gets_the_first_outcome():
    c = _committer()
    wait, other = Wait(), Wait()
    first, second = Item(_grant("a"), wait, 2, 7), Item(_grant("b"), wait, 2, 7)
    c.queue(first)
    c.queue(second)
    assert c.queued_grant("eu", "a") is first
    joiner = Item(_grant("a"), other, 2, 7)
    first.joiners.append(joiner)
    c.answer(first, result="granted-a")
    assert not wait.fut.done() and wait.open == 1
    assert other.fut.done() and joiner.result == "granted-a"  # answered with the first one's outcome
    assert c.queued_grant("eu", "a") is None
    c.answer(first, result="again")  # settled once
    assert first.result == "granted-a" and wait.open == 1
    err = Unavailable("x")
    c.answer(second, error=err)
    assert wait.fut.done() and wait.open == 0
    assert second.error is err and c.queued_grant("eu", "b") is None


async def test_queued_writes_are_open_until_answered_and_wake_the_committer():
    c = _committer()
    c._wakeup = sleep = asyncio.get_running_loop().create_future()
    wait = Wait()
    items = [Item(_grant(f"l{i}"), wait, 3, 7) for i in range(3)]
    for it in items:
        c.queue(it)
    assert sleep.done()  # the first queued item woke the committer; the others found it woken
    drained = asyncio.ensure_future(c.open_writes.drain(3))
    for it in items[:2]:
        c.answer(it, result=None)
    await asyncio.sleep(0)  # the drain runs: two of the shard's three writes answered
    assert not drained.done() and not wait.fut.done()
    c.answer(items[2], result=None)
    await drained  # the shard's last write answered: a handoff may go on
    assert wait.fut.done()
