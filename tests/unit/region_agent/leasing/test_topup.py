"""region_agent.leasing.topup: what a decision asks of the lease manager when a leased balance
could not pay, how long it may wait for the top-up in flight, and the wait itself."""

from __future__ import annotations

import asyncio

import pytest

from region_agent.leasing.book import BalanceState
from region_agent.leasing.topup import KEEP_AFTER_WAIT_S, pool_denial, topped_up, wait_s


class Leases:
    def __init__(self, pending=None, state=BalanceState.OK, hint=0):
        self.pending, self.balance_state, self.hint = pending, state, hint
        self.observed_calls: list[tuple[str, int, int]] = []
        self.start_calls: list[tuple[str, int]] = []
        self.start = object()

    def observed(self, key, spendable, starts_in_ms=0, within_ms=0.0):
        self.observed_calls.append((key, spendable, starts_in_ms))
        return self.pending

    def lease_start(self, key, starts_in_ms):
        self.start_calls.append((key, starts_in_ms))
        return self.start

    def state(self, key):
        return self.balance_state

    def retry_hint_ms(self, key):
        return self.hint


def test_pool_denial_reports_the_scripts_reading_and_the_balance_state():
    top_up = object()
    leases = Leases(pending=top_up, state=BalanceState.UNREACHABLE, hint=41)
    d = pool_denial(leases, "k", 3, waited=False, starts_in_ms=30)
    assert leases.observed_calls == [("k", 3, 30)]  # the script's reading, and when a held lease starts
    assert (d.pending, d.balance, d.retry_floor_ms) == (top_up, BalanceState.UNREACHABLE, 41)


def test_after_one_wait_there_is_no_second_and_the_floor_is_positive():
    leases = Leases(pending=object(), hint=0)
    d = pool_denial(leases, "k", 0, waited=True)
    assert d.pending is None and leases.observed_calls == []  # a waited decision does not start another
    assert d.retry_floor_ms == 1


def test_after_a_wait_a_held_lease_starting_within_the_budget_is_waited_for():
    """A decision that waited for a top-up and finds the next window's lease starting 300 ms ahead
    (a rollover) waits for that start when its budget covers it: no top-up, no reading."""
    leases = Leases(pending=object(), hint=590)
    d = pool_denial(leases, "k", 0, waited=True, starts_in_ms=300, within_ms=4_000.0)
    assert (d.pending, d.starting, d.retry_floor_ms) == (leases.start, True, 590)
    assert leases.start_calls == [("k", 300)] and leases.observed_calls == []
    for starts_in, within in ((0, 4_000.0), (300, 300.0), (300, 50.0)):  # none, or beyond the budget
        d = pool_denial(leases, "k", 0, waited=True, starts_in_ms=starts_in, within_ms=within)
        assert d.pending is None and not d.starting
    assert len(leases.start_calls) == 1


@pytest.mark.parametrize("left, budget, expected", [
    (0.050, 0.050, 0.050 - 0.0125),  # a quarter of a small budget is kept
    (0.100, 0.200, 0.100 - KEEP_AFTER_WAIT_S),  # at most 25 ms kept
    (0.020, 0.200, 0.010),  # at least half of what is left may be waited
    (0.0, 0.050, 0.0),
])
def test_wait_keeps_part_of_the_budget_for_the_call_that_follows(left, budget, expected):
    assert wait_s(left, budget) == pytest.approx(expected)


async def test_topped_up_once_the_top_up_ended_whatever_its_result():
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    done.set_result(None)
    assert await topped_up(done, 0.01)
    failed = loop.create_future()
    failed.set_exception(RuntimeError("top-up failed"))
    assert await topped_up(failed, 0.01)  # ended: the caller looks at the balance again


async def test_not_topped_up_when_it_outlasts_the_wait_or_was_cancelled():
    loop = asyncio.get_running_loop()
    slow = loop.create_future()
    assert not await topped_up(slow, 0.001)
    assert not slow.cancelled()  # shielded: the top-up goes on for the other requests
    cancelled = loop.create_future()
    cancelled.cancel()
    assert not await topped_up(cancelled, 0.01)  # the manager is stopping


async def test_a_cancelled_waiter_is_cancelled():
    loop = asyncio.get_running_loop()
    pending = loop.create_future()
    task = asyncio.ensure_future(topped_up(pending, None))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not pending.cancelled()
