"""Lease timing and epochs at the lease-manager level, with real allocator processes on a real
etcd and the real regional Redis (docs/invariants.md I18, I19):

* a grant whose reply arrives after its lease would have expired adds nothing — the fault proxy
  (``chaos.proxy``) delays the allocator's traffic beyond the lease TTL;
* a grant replayed from an older epoch after a failover (a retried leaseId answered by the new
  leader from the stored record) is refused once a newer epoch was seen.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from chaos.proxy import ProxyProcess
from kernel.bundle import Pool
from kernel.errors import StaleEpoch
from kernel.wire import LeaseRequest
from leasehold.local.procs import LOOPBACK
from region_agent.decision.keys import KeyBuilder
from region_agent.leasing.book import PoolBook
from region_agent.leasing.client import AllocatorClient
from region_agent.leasing.manager import LeaseManager
from region_agent.leasing.redis_balance import RedisBalanceStore
from region_agent.service.metrics import AgentMetrics
from region_agent.store.client import make_client
from region_agent.store.scripts import Scripts
from tests.support.policies import write_pools
from tests.support.windows import clear_of_window_edges

from .conftest import leader_url, start_topology

# a lease TTL long enough that the control's round trip (proxy, allocator, a 3-member etcd commit)
# stays well inside it on a loaded machine; the delayed reply is later still
POOL = Pool(id="timing-w", window_ms=60_000, limit=1_000, lease_ttl_ms=1_500, chunk_min=10, chunk_max=10,
            prefetch_ms=200)


class Grants:
    """The manager's LeaseEvents hook: what the allocator answered and what the region kept."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, object, float, float]] = []

    def grant(self, *, region, pool, key_tag, lease, grant, sent_at, received_at) -> None:
        self.seen.append((grant, lease, sent_at, received_at))

    def closed(self, **kw) -> None:
        pass


@pytest.fixture
def allocators(tmp_path: Path):
    topo = start_topology(tmp_path / "topo", write_pools(tmp_path / "bundle.json", [POOL], []), regions=())
    yield topo
    topo.stop()


@pytest.fixture
async def redis_client(redis_url: str):
    client = make_client(redis_url)
    yield client
    await client.aclose()


async def test_a_reply_later_than_the_lease_ttl_adds_nothing(allocators, redis_client, tmp_path: Path):
    leader = await leader_url(allocators)
    port = int(leader.rsplit(":", 1)[1])
    proxy = ProxyProcess((LOOPBACK, port), tmp_path / "proxy").start()
    client = AllocatorClient([f"http://{LOOPBACK}:{proxy.port}"], attempt_timeout_s=5.0, deadline_s=8.0,
                             max_attempts=1)
    store = RedisBalanceStore(redis_client, Scripts())
    rec = Grants()
    mgr = LeaseManager(region="eu", client=client, store=store, recorder=rec)
    key = KeyBuilder.tenant_pool_key("atlas", POOL.id)
    try:
        # a grant's TTL is clamped to its window's end: out of the window's tail, both grants below
        # carry the full 1.5 s (and are for the current window, not a prefetch of the next)
        await clear_of_window_edges(POOL.window_ms, before_ms=10_000)
        await proxy.control.latency(1_000, direction="both")  # > 2 s round trip vs a 1.5 s lease
        mgr.note(POOL, key, 1)
        await asyncio.wait_for(mgr.balances[key].inflight, 10)
        (grant, lease, sent_at, received_at), = rec.seen
        assert grant.granted == 10 and received_at - sent_at > grant.ttl_ms  # the allocator did grant...
        assert lease is None  # ...but the region timed it from the send and let it add nothing
        assert mgr.balances[key].book.leases == {}
        assert (await store.observe(key))[0] == 0
        assert (await Scripts().pool_balance(redis_client, key)).entries == {}
        async with httpx.AsyncClient(timeout=5) as http:
            record = (await http.get(f"{leader}/v1/leases/{grant.lease_id}?region={grant.region}")).json()
        assert record["grant"]["granted"] == 10  # the allocator's books show it (reclaimed on expiry)
        # control: the same path without the delay deposits the grant, spendable now
        await proxy.control.heal()
        mgr.note(POOL, key, 1)
        await asyncio.wait_for(mgr.balances[key].inflight, 10)
        grant2, lease2, _, _ = rec.seen[-1]
        assert lease2 is not None and lease2.granted == grant2.granted == 10
        assert (await store.observe(key))[0] == 10
    finally:
        await mgr.stop()
        await client.aclose()
        proxy.stop()


async def test_a_grant_replayed_from_an_older_epoch_is_refused(allocators):
    old_leader = await leader_url(allocators)
    client = AllocatorClient(allocators.allocator_urls, attempt_timeout_s=2.0, deadline_s=15.0, max_attempts=40)
    try:
        first_req = LeaseRequest(lease_id="eu-epoch-test-first", region="eu", pool=POOL.id, want=10)
        first = await client.lease(first_req)
        assert first.granted == 10
        # fail over: SIGKILL the leader; the other replica takes over with a newer epoch
        proc = allocators.allocators[allocators.allocator_urls.index(old_leader)]
        proc.kill()
        new_leader = await leader_url(allocators)
        assert new_leader != old_leader
        second = await client.lease(LeaseRequest(lease_id="eu-epoch-test-second", region="eu", pool=POOL.id,
                                                 want=10))
        assert second.epoch > first.epoch
        # a retry of the first lease id is answered from the stored record: same grant, old epoch
        replay = await client.lease(first_req)
        assert replay.replayed and replay.epoch == first.epoch and replay.granted == first.granted
        book = PoolBook(POOL)
        assert book.accept(second, sent_at=0.0, received_at=1.0) is not None
        with pytest.raises(StaleEpoch):
            book.accept(replay, sent_at=2.0, received_at=3.0)
        assert set(book.leases) == {"eu-epoch-test-second"} and book.max_epoch == second.epoch
        # the newer epoch's grants are still accepted
        third = await client.lease(LeaseRequest(lease_id="eu-epoch-test-third", region="eu", pool=POOL.id,
                                                want=10))
        assert book.accept(third, sent_at=4.0, received_at=5.0) is not None
    finally:
        await client.aclose()


async def test_a_prefetch_the_allocator_finds_early_is_not_a_refusal(allocators, redis_client):
    """A prefetch of the next window sent before its prefetch time opened on the allocator's clock
    (the agent's estimate of that clock is off by a little, a worker's tick ran early) is answered
    409 and asked again by the next tick: timing, counted ``early``. It was counted ``refused``,
    which LeaseholdLeaseRenewalFailures reads as a failing renewal: one such answer kept the
    warning pending for five minutes on a healthy fleet (seen on a 2-worker agent under a real
    Prometheus)."""
    client = AllocatorClient(allocators.allocator_urls, attempt_timeout_s=2.0, deadline_s=10.0)
    metrics = AgentMetrics()
    mgr = LeaseManager(region="eu", client=client, store=RedisBalanceStore(redis_client, Scripts()), metrics=metrics)
    key = KeyBuilder.tenant_pool_key("atlas", POOL.id)
    try:
        await clear_of_window_edges(POOL.window_ms, before_ms=10_000)  # far from the 200 ms prefetch time
        mgr.note(POOL, key, 1)
        await asyncio.wait_for(mgr.balances[key].inflight, 10)  # the current window's lease
        assert await mgr._request(mgr.balances[key], "next") is None  # the allocator answers 409: too early
        grants = {s.labels["outcome"]: s.value for s in metrics.lease_grants.collect()[0].samples
                  if s.name == "leasehold_agent_lease_grants_total"}
        assert grants.get("granted") == 1 and grants.get("early") == 1 and not grants.get("refused"), grants
    finally:
        await mgr.stop()
        await client.aclose()
