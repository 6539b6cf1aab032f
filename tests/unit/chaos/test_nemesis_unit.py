"""Nemesis plumbing without any process or network: ordering, records, validation, specs."""

from __future__ import annotations

import asyncio

import pytest

from chaos.history import Fault
from chaos.nemesis import Combined, Custom, Partition, Schedule, Step, faketime_spec
from kernel.errors import BadRequest


class ListRecorder(list):
    def write(self, rec: Fault) -> None:
        self.append(rec)


async def test_combined_starts_in_order_stops_in_reverse_and_records_each():
    log: list[str] = []
    rec = ListRecorder()
    a = Custom("replay-stale-grant", "eu", lambda: log.append("a+"), lambda: log.append("a-"), recorder=rec)

    async def b_start() -> None:
        log.append("b+")

    b = Custom("bundle-rollback", "policy", b_start, lambda: log.append("b-"), recorder=rec)
    both = Combined(a, b, recorder=rec)
    async with both.active_for():
        assert a.active and b.active
    assert log == ["a+", "b+", "b-", "a-"]
    assert [r.nemesis for r in rec] == ["bundle-rollback", "replay-stale-grant", "combined"]
    await both.stop()  # idempotent
    assert len(rec) == 3


async def test_combined_stops_every_part_even_if_one_fails():
    stopped: list[str] = []

    def boom() -> None:
        raise RuntimeError("stop failed")

    a = Custom("a", "x", lambda: None, lambda: stopped.append("a"))
    b = Custom("b", "y", lambda: None, boom)
    c = Combined(a, b)
    await c.start()
    with pytest.raises(RuntimeError, match="stop failed"):
        await c.stop()
    assert stopped == ["a"] and not a.active and not b.active


async def test_schedule_runs_instant_and_timed_steps_within_its_duration():
    seen: list[str] = []
    n1 = Custom("n1", "t", lambda: seen.append("n1+"), lambda: seen.append("n1-"))
    n2 = Custom("n2", "t", lambda: seen.append("n2+"), lambda: seen.append("n2-"))
    records = await Schedule(0.3, [Step(0.0, n1, 0.0), Step(0.1, n2, 10.0)]).run()
    assert seen == ["n1+", "n1-", "n2+", "n2-"]  # n2 cut off at the schedule's end
    assert [r.nemesis for r in records] == ["n1", "n2"]


@pytest.mark.parametrize("kw", [{"duration_s": 0}, {"duration_s": 10_000}])
def test_schedule_bounds_are_validated(kw):
    with pytest.raises(BadRequest):
        Schedule(**kw)


def test_schedule_rejects_a_step_outside_it():
    with pytest.raises(BadRequest, match="offset"):
        Schedule(1.0, [Step(2.0, Custom("x", "y", lambda: None), 0.1)])


def test_partition_direction_is_validated():
    with pytest.raises(BadRequest, match="direction"):
        Partition(object(), "sideways")


def test_faketime_specs():
    assert faketime_spec(3) == "+3s"
    assert faketime_spec(-1.5) == "-1.5s"
    assert faketime_spec(0, 1.1) == "+0 x1.1"
    with pytest.raises(BadRequest):
        faketime_spec(0, 0)


async def test_schedule_propagates_a_failing_start_and_stops_the_rest():
    other = Custom("other", "t", lambda: None, lambda: None)

    def fail() -> None:
        raise RuntimeError("cannot start")

    bad = Custom("bad", "t", fail)
    with pytest.raises(RuntimeError, match="cannot start"):
        await Schedule(5, [Step(0, other, 5), Step(0.05, bad, 1)]).run()
    assert not other.active
    await asyncio.sleep(0)
