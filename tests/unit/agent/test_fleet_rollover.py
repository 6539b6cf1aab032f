"""A fleet-wide pool's chunk renewal at a window rollover (region_agent/leasing/fleet_pools.py),
without a network: a store that answers each ``pool_take`` as scripted. The regional balance has
no spendable token but holds the next window's lease, valid in a few ms: the renewal waits for it
and buys the chunk from it, instead of denying every request until then."""

from __future__ import annotations

import time
from typing import Any

from kernel.bundle import Pool, make_rule
from region_agent.fallback import LocalAllowances
from region_agent.leasing.fleet_pools import ROLLOVER_WAIT_MS, FleetPools, TakeStatus
from region_agent.metrics import AgentMetrics
from region_agent.plan import GlobalSpend

POOL = Pool(id="g", window_ms=1_000, limit=40_000, lease_ttl_ms=1_000, chunk_min=100, chunk_max=200,
            fallback_per_region=0, prefetch_ms=200, chunk_validity_ms=1_000)
RULE = make_rule(id="global-g", scope="global", route_group="g", algorithm="pool", pool="g", fail_mode="closed")


class TakeStore:
    """Answers each submitted ``pool_take`` with the next scripted reply."""

    def __init__(self, *replies: list[int]):
        self.replies = list(replies)
        self.sent: list[Any] = []

    async def submit(self, calls, *, wait_s):
        self.sent.append(list(calls))
        return [self.replies.pop(0)]


def fleet(store: TakeStore) -> tuple[FleetPools, AgentMetrics]:
    m = AgentMetrics()
    return FleetPools(store=store, metrics=m, leases=None, now_ms=lambda: time.monotonic() * 1000.0,
                      windows=lambda pool: None, allowance=LocalAllowances(), budget_s=1.0), m  # type: ignore[arg-type]


async def test_a_lease_valid_in_a_moment_is_waited_for():
    # empty now, a lease valid in 30 ms; then 200 taken from it (valid 900 ms)
    store = TakeStore([0, 0, 0, 30], [200, 1_000, 900, 0])
    f, _ = fleet(store)
    took = await f.take(GlobalSpend(RULE, POOL, 1), time.monotonic() + 1.0, time.monotonic)
    assert took.status is TakeStatus.OK and len(store.sent) == 2
    assert f.remaining("g") == 199
    # the next request is paid by the chunk: no store call
    assert (await f.take(GlobalSpend(RULE, POOL, 1), time.monotonic() + 1.0, time.monotonic)).status is TakeStatus.OK
    assert len(store.sent) == 2


async def test_a_lease_valid_later_than_the_rollover_wait_is_a_denial_with_its_start_as_the_hint():
    store = TakeStore([0, 0, 0, ROLLOVER_WAIT_MS + 400])
    f, _ = fleet(store)
    took = await f.take(GlobalSpend(RULE, POOL, 1), time.monotonic() + 1.0, time.monotonic)
    assert took.status is TakeStatus.DENIED and len(store.sent) == 1
    assert ROLLOVER_WAIT_MS < took.retry_ms <= ROLLOVER_WAIT_MS + 400


async def test_the_rollover_wait_happens_once():
    # still empty after the wait (the lease was spent by another agent): denied, no third call
    store = TakeStore([0, 0, 0, 20], [0, 0, 0, 20])
    f, _ = fleet(store)
    took = await f.take(GlobalSpend(RULE, POOL, 1), time.monotonic() + 1.0, time.monotonic)
    assert took.status is TakeStatus.DENIED and len(store.sent) == 2
