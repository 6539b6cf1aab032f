import asyncio
import time

import pytest

from kernel.errors import AmbiguousOutcome, Overloaded, StoreUnavailable
from region_agent.store.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from region_agent.store.node import RedisNode


def test_opens_after_consecutive_failures_and_refuses_until_cool_down():
    b = CircuitBreaker(failure_threshold=3, open_s=1.0, half_open_probes=2)
    for t in range(2):
        assert b.allow(t)
        b.failure(t)
    assert b.state == CLOSED
    b.failure(2.0)
    assert b.state == OPEN
    assert not b.allow(2.5)  # open: nothing is sent
    assert b.allow(3.1) and b.state == HALF_OPEN  # cool-down over: a probe goes through
    assert b.allow(3.1)
    assert not b.allow(3.1)  # only two probes while half-open


def test_failures_a_minute_apart_open_it_and_it_stays_open_until_the_next_call():
    """A store outage at one decision a minute (docs/runbooks.md, LeaseholdFallbackShareHigh's
    floor): the failures count however far apart they are, and the state stays open between
    calls; the next call is a probe, whose failure opens it again."""
    b = CircuitBreaker(failure_threshold=5, open_s=1.0)
    for t in range(0, 300, 60):
        assert b.allow(t)
        b.failure(t)
    assert b.state == OPEN
    for _ in range(3):
        t += 60
        assert b.state == OPEN  # what the gauge reads between two calls
        assert b.allow(t) and b.state == HALF_OPEN
        b.failure(t)


def test_half_open_probe_success_closes_and_failure_reopens():
    b = CircuitBreaker(failure_threshold=1, open_s=1.0)
    b.failure(0.0)
    assert b.allow(1.5) and b.state == HALF_OPEN
    b.success()
    assert b.state == CLOSED and b.failures == 0
    b.failure(2.0)
    assert b.state == OPEN
    assert b.allow(3.5)
    b.failure(3.5)
    assert b.state == OPEN and not b.allow(4.0)


def test_a_success_resets_the_failure_count():
    b = CircuitBreaker(failure_threshold=3)
    b.failure(0)
    b.failure(0)
    b.success()
    b.failure(0)
    b.failure(0)
    assert b.state == CLOSED


def test_a_probe_that_ends_on_the_callers_deadline_gives_its_slot_back():
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, half_open_probes=1)
    b.failure(0.0)
    assert b.allow(1.5) and not b.allow(1.5)
    b.release_probe()
    assert b.allow(1.6) and b.state == HALF_OPEN


class _SlowScripts:
    """Stands in for the script runner only (no store here): a pipeline answering after ``delay_s``."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.pipelines = 0

    async def run_pipeline(self, client, calls, reading=None, held=None):
        self.pipelines += 1
        conn = object()  # a connection with no answer bytes waiting (redis_internals.answer_waiting: False)
        if reading is not None:
            reading[id(conn)] = (conn, time.monotonic())
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            if reading is not None:
                reading.pop(id(conn), None)
        return [[1, 0, 0, 1000] for _ in calls]


async def test_late_answers_of_a_busy_agent_are_used_and_never_open_the_breaker():
    """Overload (docs/concepts.md): the callers' budgets pass after their calls were sent, but the
    store answers (its pipeline is in flight for less than the stall threshold): they get the
    store's own late answers, and the breaker stays closed — nothing was wrong with the store."""
    scripts = _SlowScripts(0.05)
    gw = RedisNode(object(), scripts, breaker=CircuitBreaker(failure_threshold=3, open_s=10.0), stall_s=0.2)
    call = ("multi_rule", ["k"], [1])
    got = await asyncio.gather(*(gw.submit([call], wait_s=0.005) for _ in range(3)))
    assert got == [[[1, 0, 0, 1000]]] * 3
    assert gw.breaker.state == CLOSED and scripts.pipelines == 1


async def test_a_stalled_store_opens_the_breaker_and_a_probe_closes_it():
    """A store that stopped answering (a pipeline in flight longer than the stall threshold while the
    event loop runs on time): late callers count against it and degrade, so a hung Redis opens the
    breaker quickly. The stalled pipeline's late answer does not close it (a store slow on every
    call would otherwise never stay open, docs/decisions/0063); after ``open_s`` a probe does."""
    scripts = _SlowScripts(0.3)
    gw = RedisNode(object(), scripts, breaker=CircuitBreaker(failure_threshold=3, open_s=0.5), stall_s=0.02)
    call = ("multi_rule", ["k"], [1])
    got = await asyncio.gather(*(gw.submit([call], wait_s=0.005) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(g, AmbiguousOutcome) for g in got), got
    assert gw.breaker.state == OPEN
    with pytest.raises(StoreUnavailable):  # open: refused without sending
        await gw.submit([call], wait_s=0.2)
    await asyncio.sleep(0.35)  # the pipeline comes back without store errors, late
    assert gw.breaker.state == OPEN
    await asyncio.sleep(0.2)  # open_s passed: the next call is a probe
    scripts.delay_s = 0.0  # and the store answers on time again
    assert await gw.submit([call], wait_s=0.5) == [[1, 0, 0, 1000]]
    assert gw.breaker.state == CLOSED
    assert scripts.pipelines == 2


async def test_a_call_queued_past_its_budget_behind_a_healthy_pipeline_is_overload():
    """Not sent within the budget while the one pipeline in flight is younger than the stall
    threshold: this agent is overloaded (``Overloaded``, shed), the store is not failing."""
    scripts = _SlowScripts(0.1)
    gw = RedisNode(object(), scripts, max_inflight=1, breaker=CircuitBreaker(failure_threshold=1), stall_s=1.0)
    call = ("multi_rule", ["k"], [1])
    first = asyncio.ensure_future(gw.submit([call], wait_s=1.0))  # a future (breaker closed) or a coroutine
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        await gw.submit([call], wait_s=0.01)
    assert await first == [[1, 0, 0, 1000]]
    assert gw.breaker.state == CLOSED


async def test_a_cancelled_probe_gives_its_half_open_slot_back():
    scripts = _SlowScripts(0.5)
    br = CircuitBreaker(failure_threshold=1, open_s=0.0, half_open_probes=1)
    br.failure(0.0)
    gw = RedisNode(object(), scripts, breaker=br)
    task = asyncio.ensure_future(gw.submit([("multi_rule", ["k"], [1])], wait_s=1.0))
    await asyncio.sleep(0.01)
    assert br.state == HALF_OPEN and br.probes_in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert br.probes_in_flight == 0
