"""The coalescing batcher (region_agent/store/batcher.py): shared pipelines, order, bounds,
deadlines before and after a send (no network)."""

from __future__ import annotations

import asyncio

import pytest

from kernel.errors import AmbiguousOutcome, DeadlineExceeded, Overloaded, StoreUnavailable
from region_agent.store.batcher import Batcher


async def test_concurrent_submits_share_one_pipeline_and_keep_order():
    sent: list[list] = []

    async def run(calls):
        sent.append(list(calls))
        await asyncio.sleep(0)
        return [f"reply:{c[1][0]}" for c in calls]

    b = Batcher(run, max_batch=100)
    results = await asyncio.gather(*(b.enqueue([("s", [f"k{i}"], []), ("s", [f"k{i}b"], [])]) for i in range(10)))
    assert results == [[f"reply:k{i}", f"reply:k{i}b"] for i in range(10)]
    assert len(sent) == 1 and len(sent[0]) == 20


async def test_next_flush_starts_when_the_previous_one_finished():
    sent: list[int] = []
    gate = asyncio.Event()

    async def run(calls):
        sent.append(len(calls))
        if len(sent) == 1:
            await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=100, max_inflight=1)
    first = asyncio.ensure_future(b.enqueue([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(b.enqueue([("s", [f"k{i}"], [])])) for i in range(5)]
    await asyncio.sleep(0.01)
    assert sent == [1]  # the five wait for the in-flight pipeline
    gate.set()
    await asyncio.gather(first, *rest)
    assert sent == [1, 5]


async def test_pipelines_in_flight_are_bounded():
    sent: list[int] = []
    gates = [asyncio.Event(), asyncio.Event()]

    async def run(calls):
        sent.append(len(calls))
        if len(sent) <= 2:
            await gates[len(sent) - 1].wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=3, max_inflight=2)
    first = asyncio.ensure_future(b.enqueue([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    second = [asyncio.ensure_future(b.enqueue([("s", [f"k{i}"], [])])) for i in range(2)]
    await asyncio.sleep(0.01)
    assert sent == [1, 2]  # a second pipeline goes while the first is in flight
    third = [asyncio.ensure_future(b.enqueue([("s", [f"m{i}"], [])])) for i in range(4)]
    await asyncio.sleep(0.01)
    assert sent == [1, 2]  # both drain tasks busy: the rest waits
    gates[1].set()
    await asyncio.gather(*second)
    await asyncio.sleep(0.01)
    assert sent == [1, 2, 3, 1]  # in batches of at most max_batch
    gates[0].set()
    await asyncio.gather(first, *third)


async def test_bounded_queue_refuses_without_sending_and_deadline_before_send():
    gate = asyncio.Event()

    async def run(calls):
        await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=1, max_queue=2, max_inflight=1)
    t1 = asyncio.ensure_future(b.enqueue([("s", ["a"], [])]))
    await asyncio.sleep(0.01)  # in flight
    t2 = asyncio.ensure_future(b.enqueue([("s", ["b"], [])]))
    t3 = asyncio.ensure_future(b.enqueue([("s", ["c"], [])]))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):  # a full queue is this agent's overload, not a store failure
        await b.enqueue([("s", ["d"], [])])
    gate.set()
    await asyncio.gather(t1, t2, t3)


async def test_deadline_while_still_queued_means_never_sent():
    gate = asyncio.Event()
    sent: list[str] = []

    async def run(calls):
        sent.extend(c[1][0] for c in calls)
        await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_inflight=1)
    first = asyncio.ensure_future(b.enqueue([("s", ["a"], [])]))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded):
        await b.enqueue([("s", ["late"], [])], wait_s=0.01)
    gate.set()
    await first
    await asyncio.sleep(0.01)
    assert sent == ["a"] and b.queued == 0


async def test_a_failed_pipeline_fails_every_caller():
    async def run(calls):
        raise StoreUnavailable("down")

    b = Batcher(run, max_inflight=1)
    res = await asyncio.gather(b.enqueue([("s", ["a"], [])]), b.enqueue([("s", ["b"], [])]), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) for r in res)


async def test_a_caller_cancelled_while_queued_is_never_sent_and_leaves_the_queue():
    """A group whose caller was cancelled before its pipeline left is dropped unsent (the queue's
    count goes back down, its deadline timer is stopped); the others in the queue are sent."""
    sent: list[list] = []
    gate = asyncio.Event()

    async def run(calls):
        sent.append([c[1][0] for c in calls])
        if len(sent) == 1:
            await gate.wait()
        return [None] * len(calls)

    b = Batcher(run, max_batch=100, max_inflight=1)
    first = asyncio.ensure_future(b.enqueue([("s", ["a"], [])], wait_s=5.0))
    await asyncio.sleep(0.01)
    gone = asyncio.ensure_future(b.enqueue([("s", ["gone"], [])], wait_s=0.05))
    kept = asyncio.ensure_future(b.enqueue([("s", ["kept"], [])], wait_s=5.0))
    await asyncio.sleep(0.01)
    assert b.queued == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    gate.set()
    assert await kept == [None] and await first == [None]
    assert sent == [["a"], ["kept"]]
    assert b.queued == 0
    await asyncio.sleep(0.08)  # past the cancelled group's deadline: nothing fires on it
    assert sent == [["a"], ["kept"]]


async def test_deadlines_expire_in_time_whatever_order_their_budgets_come_in():
    """Groups wait in one deadline queue; a group with a shorter budget than the ones queued
    before it still expires on its own deadline (not behind theirs), an answered group never
    expires, and a group already sent waits its late slices, then AmbiguousOutcome."""
    gate = asyncio.Event()

    async def run(calls):
        await gate.wait()
        return [None] * len(calls)

    loop = asyncio.get_running_loop()
    b = Batcher(run, max_batch=1, max_inflight=1)
    sent = asyncio.ensure_future(b.enqueue([("s", ["sent"], [])], wait_s=0.05, late_s=lambda waited: 0.05 - waited))
    await asyncio.sleep(0.01)  # in flight, waiting on the gate
    started = loop.time()

    async def expiry(budget: float) -> tuple[type, float]:
        try:
            await b.enqueue([("s", [f"q{budget}"], [])], wait_s=budget)
        except DeadlineExceeded as e:
            return type(e), loop.time() - started
        return type(None), loop.time() - started

    long_, short = asyncio.create_task(expiry(0.30)), asyncio.create_task(expiry(0.04))
    kind, waited = await short
    assert kind is DeadlineExceeded and 0.03 <= waited < 0.30  # not held behind the 0.30 s one
    with pytest.raises(AmbiguousOutcome):  # sent: 0.05 s budget, then 0.05 s of late slices
        await sent
    gate.set()
    kind, waited = await long_
    assert kind is type(None)  # answered before its deadline: it never expires
    assert b.queued == 0


def test_a_batcher_used_from_a_second_event_loop_still_enforces_deadlines():
    """The batcher keeps its drain tasks' loop; used again from another loop (the first one closed
    with a deadline timer still armed), its callers' deadlines are enforced on the new loop."""
    gate: dict[str, asyncio.Event] = {}

    async def run(calls):
        await gate["e"].wait()
        return [None] * len(calls)

    b = Batcher(run, max_inflight=1)

    async def first_loop():
        gate["e"] = asyncio.Event()
        t = asyncio.ensure_future(b.enqueue([("s", ["a"], [])], wait_s=0.05))  # arms the deadline timer
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.sleep(0)  # asyncio.run ends the drain task; the loop closes with that timer still armed

    async def second_loop():
        await asyncio.sleep(0.1)  # past the first loop's deadline: a new group's deadline is later
        gate["e"] = asyncio.Event()  # never set: the pipeline hangs
        with pytest.raises(AmbiguousOutcome):
            await asyncio.wait_for(b.enqueue([("s", ["b"], [])], wait_s=0.02), timeout=2.0)

    asyncio.run(first_loop())
    asyncio.run(second_loop())


async def test_groups_pipelines_and_deadline_sweeps_use_the_loop_the_batcher_keeps(monkeypatch):
    """The running loop is asked for (a getpid() system call on Python 3.11) only when no drain task
    runs and no deadline sweep is armed: not per group queued behind a busy drain task, not per
    pipeline sent, not by the deadline sweep and its expiries, nor by a late wait."""
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    gate = asyncio.Event()

    async def run(calls):
        await gate.wait()
        return [f"r:{c[1][0]}" for c in calls]

    b = Batcher(run, max_batch=1, max_inflight=1)
    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    sent = b.enqueue([("s", ["sent"], [])], wait_s=0.05, late_s=lambda waited: 0.02 - waited)
    expiring = [b.enqueue([("s", [f"x{i}"], [])], wait_s=0.05) for i in range(3)]
    assert len(asked) == 1
    # the sweep expires the queued groups; the sent one waits late, then gives up (asyncio.wait asks
    # asyncio.events for the loop, not the patched name)
    await asyncio.wait_for(asyncio.wait([sent, *expiring]), timeout=30)
    assert all(isinstance(f.exception(), DeadlineExceeded) for f in expiring)
    assert isinstance(sent.exception(), AmbiguousOutcome)
    answered = [b.enqueue([("s", [f"a{i}"], [])], wait_s=10.0) for i in range(3)]  # the drain task still runs
    gate.set()
    assert await asyncio.gather(*answered) == [["r:a0"], ["r:a1"], ["r:a2"]]
    assert len(asked) == 1

