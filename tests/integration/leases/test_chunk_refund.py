"""A fleet-wide pool's chunk part that still holds tokens when its requests stop (a quiet gap in
the agent's traffic) gives them back to the lease it was bought from shortly before it ends
(region_agent.leasing.fleet_pools, ``pool_refund.lua``): the lease's close then reports them
unspent, so the allocator returns them to the window. The agent's own store on a real
redis-server; the lease is deposited as the lease manager would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kernel.bundle import Pool, make_rule
from region_agent.decision.fallback import LocalAllowances
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import GlobalSpend
from region_agent.leasing.fleet_pools import FleetPools, TakeStatus
from region_agent.leasing.redis_balance import BALANCE_SLACK_MS
from region_agent.leasing.window_clock import Windows
from region_agent.service.metrics import AgentMetrics
from region_agent.store.client import make_client
from region_agent.store.node import RedisNode
from region_agent.store.scripts import Scripts

pytestmark = pytest.mark.integration

# a chunk is valid 2 s, the lease 1.2 s: the parts bought from it end with the lease
POOL = Pool(id="fleet-refund", window_ms=10_000, limit=1_000, lease_ttl_ms=1_200, chunk_max=50,
            chunk_validity_ms=2_000)
RULE = make_rule(id="fleet-refund-rule", scope="global", algorithm="pool", pool=POOL.id, cost=1, fail_mode="closed")
GKEY = KeyBuilder.global_pool_key(POOL.id)


@pytest.fixture
async def node(redis_url: str) -> AsyncIterator[RedisNode]:
    n = RedisNode(make_client(redis_url), Scripts())
    n.start()
    yield n
    await n.close()


def fleet(node: RedisNode, m: AgentMetrics) -> FleetPools:
    return FleetPools(store=node, metrics=m, leases=None, now_ms=lambda: time.monotonic() * 1000.0,
                      windows=lambda pool: Windows(lo=0, hi=0, end_in_ms=10_000, safe_ms=10_000),
                      allowance=LocalAllowances(), budget_s=2.0)


def sample(m: AgentMetrics, name: str) -> float:
    return m.registry.get_sample_value(name, {"pool": POOL.id}) or 0.0


async def test_a_parts_unspent_rest_is_reported_unspent_by_its_lease(node: RedisNode):
    scripts, client = node.scripts, node.client
    await client.delete(GKEY)
    sec, usec = await client.time()
    t = int(sec) * 1000 + int(usec) // 1000
    dep = await scripts.pool_deposit(client, GKEY, "L1", granted=100, valid_from_ms=t - 10, expires_at_ms=t + 1_200,
                                     max_entries=16, slack_ms=BALANCE_SLACK_MS)
    assert dep.stored
    m = AgentMetrics()
    f = fleet(node, m)
    spend = GlobalSpend(RULE, POOL, 1)
    admitted = 0
    # a few requests at once: the chunk grows with them, and its last part is left holding tokens
    while admitted < 4 or f.remaining(POOL.id) == 0:
        assert admitted < 30
        took = await f.take(spend, time.monotonic() + 2.0, time.monotonic)
        assert took.status is TakeStatus.OK
        admitted += 1
    held = f.remaining(POOL.id)
    assert held > 0, "the chunk holds no tokens: nothing to refund (the test needs a quiet part)"
    bought = admitted + held
    # no requests now: the part's timer refunds its rest shortly before it ends with the lease
    deadline = time.monotonic() + 10
    while sample(m, "leasehold_agent_chunk_refunded_tokens_total") + sample(
            m, "leasehold_agent_chunk_abandoned_tokens_total") < held:
        assert time.monotonic() < deadline, "no refund was made (or counted)"
        await asyncio.sleep(0.05)
    assert f.remaining(POOL.id) == 0
    refunded = sample(m, "leasehold_agent_chunk_refunded_tokens_total")
    assert refunded == held and sample(m, "leasehold_agent_chunk_abandoned_tokens_total") == 0
    # the depositing agent closes the lease after its end: what was given back is reported unspent
    while True:
        sec, usec = await client.time()
        if int(sec) * 1000 + int(usec) // 1000 >= t + 1_200:
            break
        await asyncio.sleep(0.05)
    closed = await scripts.pool_close(client, GKEY, "L1")
    assert closed is not None and closed.current
    assert closed.spent == admitted < bought, (closed, admitted, bought)
