"""The Redis node's judgement of the store (region_agent/store/node.py), without a network:
the pipeline runner is scripted (``Scripts.run_pipeline``'s place), the breaker and the loop-lag
monitor are the real ones. The Redis paths (NOSCRIPT reload, cluster routing, stalls) are
tests/integration/scripts and tests/integration/region_agent."""

from __future__ import annotations

import pytest
import redis.exceptions as rex

from kernel.errors import AmbiguousOutcome, NothingRan, Overloaded, ScriptRejected, StoreUnavailable
from region_agent.store.breaker import CLOSED, OPEN, CircuitBreaker
from region_agent.store.lag import LoopLag
from region_agent.store.node import RedisNode

CALL = ("multi_rule", ["k"], [0, 0, "m", "tb", 1, 1, 1, 1, 0, ""])


class ScriptedRunner:
    """Answers each pipeline with the next scripted item: replies, or an exception raised."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.pipelines = 0

    async def run_pipeline(self, client, calls, reading, held=None):
        self.pipelines += 1
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class Lagging(LoopLag):
    """An event loop that runs ``lag`` seconds late (this agent saturated)."""

    def __init__(self, lag: float):
        super().__init__()
        self.lag = lag

    def lag_s(self, now: float) -> float:
        return self.lag


def node(runner: ScriptedRunner, *, failures: int = 2, lag: float = 0.0):
    states: list[int] = []
    gw = RedisNode(object(), runner, breaker=CircuitBreaker(failure_threshold=failures, open_s=60.0),  # type: ignore[arg-type]  # a fake client and scripted runner in place of redis-py
                      on_breaker=states.append, lag=Lagging(lag), late_s=0.4, connect_timeout_s=0.2)
    return gw, states


async def test_replies_come_back_in_order_and_a_good_pipeline_keeps_the_breaker_closed():
    gw, states = node(ScriptedRunner([[1, 0, 0, 5], ScriptRejected("bad args")]))
    replies = await gw.submit([CALL, CALL], wait_s=1.0)
    assert replies[0] == [1, 0, 0, 5] and isinstance(replies[1], ScriptRejected)  # a contract error, in its slot
    assert states[-1] == CLOSED
    await gw.close()


async def test_store_failures_open_the_breaker_and_then_nothing_is_sent():
    # (Scripts.run_pipeline raises its translated error: unreachable before anything was sent)
    runner = ScriptedRunner(StoreUnavailable("store unreachable"), [StoreUnavailable("down")])
    gw, states = node(runner)
    with pytest.raises(StoreUnavailable):  # nothing was sent: a plain store failure
        await gw.submit([CALL], wait_s=1.0)
    (reply,) = await gw.submit([CALL], wait_s=1.0)  # a store error in a slot counts too
    assert isinstance(reply, StoreUnavailable)
    assert states[-1] == OPEN
    with pytest.raises(StoreUnavailable, match="circuit breaker open"):
        await gw.submit([CALL], wait_s=1.0)
    assert runner.pipelines == 2
    await gw.close()


async def test_a_timeout_after_send_is_ambiguous_and_counts_against_the_store():
    gw, states = node(ScriptedRunner(rex.TimeoutError("Timeout reading from socket")), failures=1)
    with pytest.raises(AmbiguousOutcome):
        await gw.submit([CALL], wait_s=1.0)
    assert states[-1] == OPEN
    await gw.close()


async def test_a_timeout_while_this_agent_lags_is_overload_and_the_store_is_not_blamed():
    gw, states = node(ScriptedRunner(rex.TimeoutError("Timeout reading from socket")), failures=1, lag=0.2)
    with pytest.raises(Overloaded):  # lag 0.2 s >= late_s / 4: the agent was busy, not the store
        await gw.submit([CALL], wait_s=1.0)
    assert OPEN not in states and gw.breaker.state == CLOSED
    await gw.close()


async def test_a_call_that_did_not_run_counts_against_the_store_and_is_judged_by_its_read_timeout():
    """NothingRan in a reply's place (NOSCRIPT, then the reload's connection lost) is a store
    failure for the breaker, like any other; when its reload timed out reading, the agent's own
    lag excuses it as it does a sent call (``late_s``), not as a connect (``connect_timeout_s``)."""
    gw, states = node(ScriptedRunner([NothingRan("reload lost")]), failures=1)
    (reply,) = await gw.submit([CALL], wait_s=1.0)
    assert isinstance(reply, NothingRan) and states[-1] == OPEN
    await gw.close()
    timed_out = NothingRan("reload timed out", extra={"cause": "timeout"})
    for lag, kind in ((0.06, NothingRan), (0.2, Overloaded)):  # connect_timeout_s / 4 = 0.05, late_s / 4 = 0.1
        gw, _ = node(ScriptedRunner([timed_out]), failures=1, lag=lag)
        (reply,) = await gw.submit([CALL], wait_s=1.0)
        assert type(reply) is kind, (lag, reply)
        await gw.close()


class SlowRunner:
    """A store that answers every pipeline, ``delay_s`` after it was sent (a slow Redis)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.pipelines = 0

    async def run_pipeline(self, client, calls, reading, held=None):
        import asyncio
        import time

        self.pipelines += 1
        token = object()
        reading[id(token)] = (None, time.monotonic())  # sent: the store owes the answer
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            reading.pop(id(token), None)
        return [[1, 0, 0, 5] for _ in calls]


async def test_a_store_slower_than_every_decision_opens_the_breaker():
    """Each caller's budget passes (ambiguous: counted) before its pipeline's late answer; that
    answer used to close the breaker again, so a store slow on every call never opened it."""
    import asyncio

    runner = SlowRunner(0.12)
    gw = RedisNode(object(), runner, breaker=CircuitBreaker(failure_threshold=3, open_s=60.0),  # type: ignore[arg-type]  # a fake client and scripted runner
                   lag=Lagging(0.0), late_s=0.4, stall_s=0.03)
    for _ in range(3):
        with pytest.raises(AmbiguousOutcome):
            await gw.submit([CALL], wait_s=0.01)
    await asyncio.sleep(0.2)  # every late answer is in
    assert gw.breaker.state == OPEN
    with pytest.raises(StoreUnavailable, match="circuit breaker open"):  # degraded at once from now on
        await gw.submit([CALL], wait_s=0.01)
    await gw.close()


async def test_a_late_answer_while_this_agent_lags_still_closes_the_breaker():
    import asyncio

    gw = RedisNode(object(), SlowRunner(0.12), breaker=CircuitBreaker(failure_threshold=1, open_s=60.0),  # type: ignore[arg-type]  # a fake client and scripted runner
                   lag=Lagging(0.1), late_s=0.4, stall_s=0.03)
    gw.breaker.failures = 0
    await gw.submit([CALL], wait_s=1.0)  # answered (the loop lags: the late answer is this agent's own)
    await asyncio.sleep(0)
    assert gw.breaker.state == CLOSED
    await gw.close()


async def test_the_breaker_callback_hears_each_change_once_not_each_pipeline():
    """on_breaker (the breaker gauge) is told the state when it changes, not again after every
    pipeline that leaves it as it was: the gauge reads the same, without a locked set per pipeline."""
    ok = [[1, 0, 0, 5]]
    runner = ScriptedRunner(ok, ok, ok, StoreUnavailable("down"), StoreUnavailable("down"))
    gw, states = node(runner, failures=2)
    for _ in range(3):
        await gw.submit([CALL], wait_s=1.0)
    assert states == [CLOSED]
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            await gw.submit([CALL], wait_s=1.0)
    assert states == [CLOSED, OPEN]  # the first failure left it closed: nothing new to tell
    await gw.close()
