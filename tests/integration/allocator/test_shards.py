"""Shards of leadership on a real 3-member etcd, replicas in process (fast): the spread, routing
answers, per-shard fencing inside a transaction, handoff on join with idempotent retries, a
graceful leave, and the guard against replicas of another shard count.
(``test_shards_processes.py`` runs real processes: SIGKILL, SIGSTOP, join and leave under load.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from litestar.testing import AsyncTestClient

from allocator.app import create_app
from allocator.settings import AllocatorSettings
from allocator.shards import assignment
from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from kernel.shards import shard_of
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import lease_body, settings_for
from tests.support.waiting import await_until

from .conftest import W
from .support import etcd_grants, etcd_windows, usurp

SHARDS = 8


def _pools(n: int, limit: int = 1_000) -> list[Pool]:
    return [Pool(id=f"p{i}", window_ms=W, limit=limit, chunk_max=100) for i in range(n)]


class Replica:
    def __init__(self, settings: AllocatorSettings, **kw: Any) -> None:
        self.settings = settings
        self.app = create_app(settings, **kw)
        self.client = AsyncTestClient(app=self.app, timeout=30)
        self.node = settings.node_id
        self.url = settings.url

    @property
    def election(self) -> Any:
        return self.app.state.election

    @property
    def led(self) -> set[int]:
        return set(self.election.led)

    async def __aenter__(self) -> Replica:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)


def sharded(cluster: EtcdCluster, bundle, prefix: str, node: str, port: int, shards: int = SHARDS,
            **kw: Any) -> AllocatorSettings:
    kw.setdefault("election_ttl_s", 2)
    return settings_for(cluster, bundle, prefix, node_id=node, port=port, shards=shards, **kw)


async def converged(reps: list[Replica], shards: int = SHARDS, within_s: float = 20.0) -> dict[int, str]:
    """Every replica leads the shards the assignment gives it, and every replica's map says so."""
    want = assignment(shards, {r.node for r in reps})

    def done() -> bool:
        return all(r.led == {s for s, n in want.items() if n == r.node}
                   and [sl.node_id for sl in r.election.shard_map().leaders] == [want[s] for s in range(shards)]
                   for r in reps)
    assert await await_until(done, within_s=within_s), (f"not converged on {want}: "
                                                      f"{[(r.node, sorted(r.led)) for r in reps]}")
    return want


@contextlib.asynccontextmanager
async def replicas(*settings: AllocatorSettings) -> AsyncIterator[list[Replica]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Replica(s)) for s in settings]


async def test_two_replicas_split_the_shards_and_name_each_pools_leader(etcd_cluster, make_bundle, prefix: str,
                                                                        etcd_reader: EtcdStore) -> None:
    pools = _pools(12)
    bundle = make_bundle(*pools)
    async with replicas(sharded(etcd_cluster, bundle, prefix, "ra", 18101),
                        sharded(etcd_cluster, bundle, prefix, "rb", 18102)) as reps:
        want = await converged(reps)
        by_node = {r.node: r for r in reps}
        shard_map = (await reps[0].client.get("/v1/shards")).json()
        assert shard_map["shards"] == SHARDS and shard_map["hash"] == "blake2b64-mod"
        assert {m["nodeId"] for m in shard_map["members"]} == {"ra", "rb"}
        for entry in shard_map["leaders"]:
            key = await etcd_reader.get(f"{prefix}leader/{entry['shard']}".encode())
            assert entry["nodeId"] == want[entry["shard"]] and entry["epoch"] == key.create_revision
        # both replicas read the same map (any replica answers reads)
        other = (await reps[1].client.get("/v1/shards")).json()
        assert other["leaders"] == shard_map["leaders"]
        for pool in pools:
            shard = shard_of(pool.id, SHARDS)
            right = by_node[want[shard]]
            wrong = next(r for r in reps if r is not right)
            r = await wrong.client.post("/v1/leases", json=lease_body(f"route-{pool.id}-1", pool.id, "eu", 5))
            body = r.json()
            assert r.status_code == 503 and body["type"].endswith("/not-leader")
            assert body["leader"] == right.url and body["leaderNodeId"] == right.node
            assert body["shard"] == shard and body["shards"] == SHARDS
            ok = await right.client.post("/v1/leases", json=lease_body(f"route-{pool.id}-1", pool.id, "eu", 5))
            assert ok.status_code == 200 and ok.json()["epoch"] == shard_map["leaders"][shard]["epoch"]
        # a batch spanning shards: the items of the other replica's shards are not-leader, the rest granted
        reqs = [lease_body(f"route-batch-{p.id}", p.id, "eu", 1) for p in pools]
        res = (await reps[0].client.post("/v1/leases/batch", json={"requests": reqs})).json()["results"]
        for p, item in zip(pools, res, strict=True):
            mine = want[shard_of(p.id, SHARDS)] == "ra"
            assert (item.get("granted") == 1) if mine else (item["code"] == "not-leader"), item
        info = (await reps[0].client.get("/v1/leader")).json()
        assert info["shards"] == SHARDS and info["leading"] == len(reps[0].led)
        assert info["nodeId"] == want[0] and info["isSelf"] == (want[0] == "ra")
        ready = (await reps[1].client.get("/readyz")).json()
        assert ready["shards"] == SHARDS and ready["shardsLed"] == len(reps[1].led)
        # what LeaseholdNoAllocatorLeader adds up: every shard is led by one of the two
        led = [(await r.client.get("/metrics")).text for r in reps]
        assert all(f"leasehold_allocator_shards {SHARDS}.0" in t for t in led)
        assert sum(float(t.split("\nleasehold_allocator_shards_led ")[1].split()[0]) for t in led) == SHARDS
    grants = await etcd_grants(etcd_reader, prefix)
    assert len(grants) == len(pools) + sum(1 for p in pools if want[shard_of(p.id, SHARDS)] == "ra")


async def test_a_deposed_shard_is_fenced_inside_a_transaction_spanning_shards(
        etcd_cluster, make_bundle, prefix: str, etcd_reader: EtcdStore) -> None:
    """One replica leads every shard; another node replaces one shard's leader key. A batch over
    pools of many shards: the deposed shard's grants are fenced (nothing committed), the others
    commit, and the replica steps down from that shard only."""
    pools = _pools(16)
    bundle = make_bundle(*pools)
    async with replicas(sharded(etcd_cluster, bundle, prefix, "solo", 18111)) as (solo,):
        await converged([solo])
        victim = shard_of("p0", SHARDS)
        key = f"{prefix}leader/{victim}".encode()
        old = (await etcd_reader.get(key)).create_revision
        lease = await usurp(etcd_reader, key, old)
        assert victim in solo.led  # not noticed yet
        reqs = [lease_body(f"fence-{p.id}", p.id, "eu", 3) for p in pools]
        res = (await solo.client.post("/v1/leases/batch", json={"requests": reqs})).json()["results"]
        for p, item in zip(pools, res, strict=True):
            if shard_of(p.id, SHARDS) == victim:
                assert item["code"] in ("fenced", "not-leader"), item
            else:
                assert item["granted"] == 3, item
        assert victim not in solo.led and len(solo.led) == SHARDS - 1
        assert "leasehold_allocator_fenced_total 1.0" in (await solo.client.get("/metrics")).text
        await etcd_reader.lease_revoke(lease)
        assert await await_until(lambda: victim in solo.led), \
            (victim, sorted(solo.led))  # the usurper is gone: the shard comes back
    grants = await etcd_grants(etcd_reader, prefix)
    assert set(grants) == {f"fence-{p.id}" for p in pools if shard_of(p.id, SHARDS) != victim}


async def test_a_join_hands_shards_off_and_retries_get_the_stored_grant(etcd_cluster, make_bundle, prefix: str,
                                                                          etcd_reader: EtcdStore) -> None:
    pools = _pools(12, limit=400)
    bundle = make_bundle(*pools)
    sa = sharded(etcd_cluster, bundle, prefix, "ja", 18121)
    sb = sharded(etcd_cluster, bundle, prefix, "jb", 18122)
    moving = [p.id for p in pools if assignment(SHARDS, {"ja", "jb"})[shard_of(p.id, SHARDS)] == "jb"]
    assert moving, "the test needs pools that move to the newcomer"
    acked: dict[str, dict] = {}
    async with replicas(sa) as (a,):
        await converged([a])
        first = {p: (await a.client.post("/v1/leases", json=lease_body(f"join-{p}-0", p, "eu", 10))).json()
                 for p in moving}
        stop = asyncio.Event()

        async def load(region: str) -> None:
            """Grants on every pool during the join, following not-leader answers (bounded)."""
            targets = {"ja": a}
            n = 0
            while not stop.is_set() and n < 400:
                for p in pools:
                    n += 1
                    body = lease_body(f"join-{region}-{p.id}-{n}", p.id, region, 7)
                    for _ in range(20):
                        rep = next(iter(targets.values()))
                        for r in list(targets.values()):
                            if shard_of(p.id, SHARDS) in r.led:
                                rep = r
                        resp = await rep.client.post("/v1/leases", json=body)
                        if resp.status_code == 200:
                            acked[body["leaseId"]] = resp.json()
                            break
                        assert resp.status_code == 503, resp.text
                        await asyncio.sleep(0.02)
                    if b_rep is not None:
                        targets["jb"] = b_rep
                await asyncio.sleep(0.01)

        b_rep: Replica | None = None
        tasks = [asyncio.create_task(load(r)) for r in ("eu", "us")]
        await asyncio.sleep(0.3)
        async with replicas(sb) as (b,):
            b_rep = b
            await converged([a, b])
            await asyncio.sleep(0.3)
            # the load ran through the join (a loaded machine may have managed few grants so far)
            assert await await_until(lambda: len(acked) > 50 or all(t.done() for t in tasks), within_s=30), \
                (len(acked), [t.done() for t in tasks])
            stop.set()
            await asyncio.gather(*tasks)
            for p in moving:  # the retried lease id, now at the new leader: the stored grant
                again = (await b.client.post("/v1/leases", json=lease_body(f"join-{p}-0", p, "eu", 10))).json()
                assert again["replayed"] is True and again["epoch"] == first[p]["epoch"]
                assert again["granted"] == first[p]["granted"]
                fresh = (await b.client.post("/v1/leases", json=lease_body(f"join-{p}-1", p, "eu", 1))).json()
                assert fresh["epoch"] > first[p]["epoch"]
                assert (await a.client.post("/v1/leases", json=lease_body(f"join-{p}-2", p, "eu", 1))).status_code \
                    == 503
    assert len(acked) > 50
    stored = await etcd_grants(etcd_reader, prefix)
    for lease_id, g in acked.items():  # every acknowledged grant is in etcd as answered
        assert stored[lease_id].grant.granted == g["granted"] and stored[lease_id].grant.epoch == g["epoch"]
    for p in pools:  # never beyond G, and etcd's window state agrees with its grant records
        for k, w in (await etcd_windows(etcd_reader, prefix, p.id)).items():
            recs = [r for r in stored.values() if r.grant.pool == p.id and r.grant.window.index == k]
            assert sum(r.grant.granted for r in recs) == w.total_granted <= p.limit
            assert w.remaining == w.limit - w.total_granted


async def test_a_graceful_leave_hands_every_shard_to_the_others_at_once(etcd_cluster, make_bundle,
                                                                         prefix: str) -> None:
    bundle = make_bundle(*_pools(4))
    # an etcd lease of 9 s, renewed every 3 s: had b not revoked it, a could take b's shards no sooner
    # than 6 s after b left, far from the few polls of a graceful handoff even on a loaded machine
    sa = sharded(etcd_cluster, bundle, prefix, "la", 18131, election_ttl_s=9)
    sb = sharded(etcd_cluster, bundle, prefix, "lb", 18132, election_ttl_s=9)
    async with replicas(sa) as (a,):
        async with replicas(sb) as (b,):
            await converged([a, b])
            assert b.led
        # b revoked its lease on the way out: a takes b's shards at its next poll, not after a TTL
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await converged([a], within_s=5)
        assert loop.time() - t0 < 4.0


async def test_a_replica_of_another_shard_count_does_not_campaign(etcd_cluster, make_bundle, prefix: str) -> None:
    bundle = make_bundle(*_pools(2))
    async with replicas(sharded(etcd_cluster, bundle, prefix, "ca", 18141)) as (a,):
        await converged([a])
        async with replicas(sharded(etcd_cluster, bundle, prefix, "cb", 18142, shards=4)) as (b,):
            assert await await_until(lambda: b.election.config_error is not None), \
                "a replica of another shard count has no config error"
            assert "8 shards" in b.election.config_error and not b.led
            r = await b.client.get("/readyz")
            assert r.status_code == 503 and "--shards" in r.json()["detail"]
            await asyncio.sleep(1.0)
            assert len(a.led) == SHARDS  # nothing was handed to it
