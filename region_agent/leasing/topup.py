"""Waiting for a leased pool balance's top-up: what a decision asks of the lease manager when a
pool balance could not pay, and how long it may wait.

A tenant pool rule's balance (``{t:<tenant>}``) or a fleet-wide pool's (``{g:<pool>}``) can be
empty while the lease manager's top-up is in flight - at cold start (the warm-up lease, or the
first request of a balance) or when demand outran the low-water mark. A request then waits for
that top-up *once*, within its own budget, and asks again; it never waits for a top-up that was
not started, and an answer of "exhausted" or "unreachable" is carried out at once
(region_agent.decision.outcome: a 429 to the next window, or the pool's fallback allowance).
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from .book import BalanceState

# A balance with no spendable token but a lease that becomes valid within this many ms (the next
# window's prefetched lease at a window rollover, its start rounded up by the Redis clock offset):
# a decision (a tenant pool's: LeaseManager.observed; a fleet-wide pool's chunk renewal) waits for
# it instead of being denied until then. Requests still wait only within their own budgets (a
# longer wait is a 429 or a pool-busy denial, never a fallback).
ROLLOVER_WAIT_MS = 100
# A renewal that waited for a lease's start and still finds it ahead (the store's clock said "1 ms"
# more: see until_start_s) waits again, at most this many times in all
ROLLOVER_WAITS = 3

# the part of a waiting decision's budget kept for the call that follows the wait (the script
# again, or the fallback allowance): without it that call times out and degrades as if Redis were down
KEEP_AFTER_WAIT_S = 0.025


class PoolDenial(NamedTuple):
    """What the lease manager says about a balance that just could not pay."""

    pending: asyncio.Future | None  # the top-up in flight, or a lease's start (None: none, or already waited for)
    balance: BalanceState  # region_agent.decision.outcome decides with it
    retry_floor_ms: int  # a denial's hint is at least this (a top-up's round trip, or the window's end)
    starting: bool = False  # ``pending`` is only a held lease's start (after a wait for a top-up)


def pool_denial(leases: Any, key: str, spendable: int, *, waited: bool, starts_in_ms: int = 0,
                within_ms: float = 0.0) -> PoolDenial:
    """Tell ``leases`` (a :class:`~region_agent.leasing.manager.LeaseManager`) that a script saw
    ``spendable`` tokens in ``key``'s balance - fresher than its tick's reading - and read the
    balance's state. ``waited``: this decision already waited for a top-up (no second one);
    ``starts_in_ms``: the script's hint, when a lease of the balance starts that soon (0: none): the
    decision may wait for it; ``within_ms``: how long the decision may still wait (its budget).

    A decision that already waited for a top-up and finds a held lease starting within what is left
    of its budget (the next window's lease, at a rollover: a top-up that took it, or one that ended
    just before the window did) waits for that start too: it starts no top-up, and the script
    spends the lease only from its start."""
    hint = max(1, leases.retry_hint_ms(key))
    if not waited:
        return PoolDenial(leases.observed(key, int(spendable), starts_in_ms, within_ms), leases.state(key), hint)
    if 0 < starts_in_ms and until_start_s(starts_in_ms) * 1000.0 <= within_ms:
        return PoolDenial(leases.lease_start(key, starts_in_ms), leases.state(key), hint, starting=True)
    return PoolDenial(None, leases.state(key), hint)


def until_start_s(starts_in_ms: float) -> float:
    """How long to wait for a lease the store says starts in ``starts_in_ms`` (whole ms, its clock
    floored): one ms longer. The event loop's timers count whole ms from a loop time truncated to
    the ms (uvloop on libuv), so a wait of exactly ``starts_in_ms`` may end up to 1 ms early, and
    the next call, within a fraction of a ms on a local store, would find the lease still ahead."""
    return (starts_in_ms + 1) / 1000.0


def wait_s(left_s: float, budget_s: float) -> float:
    """How long a decision with ``left_s`` of its budget may wait for a top-up: all but the part
    kept for the call that follows (at least half of what is left)."""
    return max(left_s / 2, left_s - min(KEEP_AFTER_WAIT_S, budget_s / 4))


async def topped_up(pending: asyncio.Future, within_s: float | None) -> bool:
    """Wait for the lease manager's top-up in flight: True once it ended (granted or not - the
    caller looks at the balance again), False if it did not end in time or was cancelled (the
    manager is stopping)."""
    try:
        await asyncio.wait_for(asyncio.shield(pending), within_s)
    except TimeoutError:
        return False
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if pending.cancelled() and not (task is not None and task.cancelling()):
            return False
        raise
    except Exception:
        return True
    return True
