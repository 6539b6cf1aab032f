"""RLS calls that arrive together are decided together (region_agent.gateways.call_group): a call
alone is not held; a call that arrives while others are in flight joins a group, which is decided
with one admission when the linger passes or when it is full; each call gets its own decisions,
and a group whose decision raises is decided call by call."""

from __future__ import annotations

import asyncio

import pytest

from kernel.errors import Unavailable, ValidationFailed
from region_agent.gateways.call_group import CallGroup


class Admission:
    """Stands in for the admission at this unit's boundary: records each ask, answers each question
    with its own request id (a real admission's answers: tests/integration/region_agent/test_gateways.py)."""

    def __init__(self, refuse: str | None = None, error: Exception | None = None):
        self.asks: list[list[str]] = []
        self.refuse = refuse  # a question id the engine refuses (ValidationFailed), alone or in a group
        self.error = error

    async def __call__(self, questions):
        self.asks.append(list(questions))
        await asyncio.sleep(0)
        if self.error is not None:
            raise self.error
        if self.refuse in questions:
            raise ValidationFailed(f"{self.refuse} refused")
        return [f"decision:{q}" for q in questions]


async def test_a_call_alone_is_not_held():
    g = CallGroup(Admission(), 10.0)
    for _ in range(3):
        assert g.enter() is False
        g.leave()
    assert g.in_flight == 0


async def test_no_linger_means_no_group_even_under_load():
    g = CallGroup(Admission(), 0.0)
    assert [g.enter() for _ in range(5)] == [False] * 5
    assert g.in_flight == 5


async def test_calls_beside_others_are_decided_in_one_ask_each_with_its_own_decisions():
    adm = Admission()
    g = CallGroup(adm, 0.02)
    assert g.enter() is False  # the first call goes alone
    assert [g.enter() for _ in range(3)] == [True] * 3
    got = await asyncio.wait_for(asyncio.gather(g.decide(["a"]), g.decide(["b1", "b2"]), g.decide(["c"])), 10)
    assert got == [["decision:a"], ["decision:b1", "decision:b2"], ["decision:c"]]
    assert adm.asks == [["a", "b1", "b2", "c"]]  # one ask for the group, questions in arrival order


async def test_a_full_group_is_decided_at_once_without_the_linger():
    adm = Admission()
    g = CallGroup(adm, 3600.0, size=4)  # a linger that never passes here: only the size starts it
    first = [asyncio.ensure_future(g.decide([f"q{i}"])) for i in range(3)]
    await asyncio.sleep(0.01)
    assert adm.asks == [] and not any(f.done() for f in first)  # held: the group is not full
    last = asyncio.ensure_future(g.decide(["q3"]))
    got = await asyncio.wait_for(asyncio.gather(*first, last), 10)
    assert got == [[f"decision:q{i}"] for i in range(4)] and adm.asks == [["q0", "q1", "q2", "q3"]]


async def test_a_refused_question_fails_only_its_own_call():
    adm = Admission(refuse="bad")
    g = CallGroup(adm, 0.01)
    got = await asyncio.wait_for(asyncio.gather(g.decide(["a"]), g.decide(["bad"]), g.decide(["c"]),
                                                return_exceptions=True), 10)
    assert got[0] == ["decision:a"] and got[2] == ["decision:c"]
    assert isinstance(got[1], ValidationFailed)
    assert adm.asks[0] == ["a", "bad", "c"] and sorted(map(tuple, adm.asks[1:])) == [("a",), ("bad",), ("c",)]


async def test_an_agent_still_starting_fails_every_call_of_the_group():
    g = CallGroup(Admission(error=Unavailable("agent is starting")), 0.01)
    got = await asyncio.wait_for(asyncio.gather(g.decide(["a"]), g.decide(["b"]), return_exceptions=True), 10)
    assert all(isinstance(x, Unavailable) for x in got)


async def test_a_cancelled_caller_is_left_out_and_the_rest_are_decided():
    adm = Admission()
    g = CallGroup(adm, 3600.0)
    a = asyncio.ensure_future(g.decide(["a"]))
    b = asyncio.ensure_future(g.decide(["b"]))
    await asyncio.sleep(0)
    a.cancel()
    await asyncio.sleep(0)
    g.release()
    assert await asyncio.wait_for(b, 10) == ["decision:b"]
    assert adm.asks == [["b"]]
    with pytest.raises(asyncio.CancelledError):
        await a


async def test_an_unexpected_error_in_the_group_is_narrowed_to_the_call_that_causes_it():
    class Fussy(Admission):
        async def __call__(self, questions):
            self.asks.append(list(questions))
            if "boom" in questions:
                raise RuntimeError("a defect one question triggers")
            return [f"decision:{q}" for q in questions]

    g = CallGroup(Fussy(), 0.01)
    got = await asyncio.wait_for(asyncio.gather(g.decide(["a"]), g.decide(["boom"]), return_exceptions=True), 10)
    assert got[0] == ["decision:a"] and isinstance(got[1], RuntimeError)


async def test_a_call_waits_on_a_future_of_its_own_not_a_coroutine():
    g = CallGroup(Admission(), 0.01)
    mine = g.decide(["a"])
    assert isinstance(mine, asyncio.Future)  # awaited by the door directly: no coroutine frame per call
    assert await asyncio.wait_for(mine, 10) == ["decision:a"]


async def test_calls_joining_a_group_use_the_loop_the_group_keeps(monkeypatch):
    """The running loop is asked for (a getpid() system call on Python 3.11) by a call that finds
    no group waiting and none being decided, not by every call that joins one, nor by a release."""
    asked: list[int] = []
    real = asyncio.get_running_loop

    def counting() -> asyncio.AbstractEventLoop:
        asked.append(1)
        return real()

    g = CallGroup(Admission(), 3600.0, size=3)
    monkeypatch.setattr(asyncio, "get_running_loop", counting)
    got = [g.decide([f"q{i}"]) for i in range(3)]  # the third fills the group: released at once
    got += [g.decide([f"q{i}"]) for i in range(3, 5)]  # while the first group is decided
    assert len(asked) == 1
    g.release()
    assert await asyncio.wait_for(asyncio.gather(*got), 10) == [[f"decision:q{i}"] for i in range(5)]
    assert len(asked) == 1


def test_a_group_used_from_a_second_event_loop_still_lingers_and_decides():
    """Used again from another loop (the first one closed while a call waited with its linger timer
    armed), a call's group is timed and decided on the new loop."""
    g = CallGroup(Admission(), 0.01)

    async def first_loop():
        g.decide(["a"])  # arms the linger's timer; the loop closes before it fires

    async def second_loop():
        return await asyncio.wait_for(g.decide(["b"]), 2.0)

    asyncio.run(first_loop())
    assert asyncio.run(second_loop()) == ["decision:b"]
