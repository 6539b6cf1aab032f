"""Three ``python -m allocator --shards 64`` replicas as real processes on a real 3-member etcd:
the shards spread; under lease load a SIGKILL of the replica leading the most shards (its shards
move within the election TTL plus a poll), its restart (a join: shards hand back) and a graceful
leave, then the chaos checker over the history and etcd's records; a SIGSTOP of a replica (its
shards taken over, its accepted grants fenced on resume); the agent's client routing by shard."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from allocator.shards import assignment, spread
from chaos.checker import check
from chaos.etcd_records import read_back, read_leaders
from chaos.history import HistoryWriter, Leader, Meta, now_ms
from chaos.lease_driver import LeaseDriver
from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from kernel.shards import shard_of
from kernel.wire import LeaseRequest, UsageReceipt, UsageReport
from leasehold.local.procs import EtcdCluster
from region_agent.leasing.client import AllocatorClient
from tests.support.allocator_app import lease_body
from tests.support.waiting import await_until

from .support import AllocatorProcess, etcd_grants

SHARDS = 64
TTL_S = 2
NODES = ("alloc-1", "alloc-2", "alloc-3")
POOLS = [Pool(id=f"g{i}", window_ms=4_000, limit=120, lease_ttl_ms=1_500, chunk_max=12, prefetch_ms=500)
         for i in range(6)]


@pytest.fixture
def three(tmp_path: Path, etcd_cluster: EtcdCluster, make_bundle, prefix: str) -> Iterator[list[AllocatorProcess]]:
    bundle = make_bundle(*POOLS)
    procs = [AllocatorProcess(tmp_path, etcd_cluster, bundle, prefix, n, election_ttl_s=TTL_S,
                              settings={"shards": SHARDS}) for n in NODES]
    try:
        for p in procs:
            p.proc.start()
        for p in procs:
            p.start_wait()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def maps(procs: list[AllocatorProcess]) -> dict[str, dict]:
    out = {}
    async with httpx.AsyncClient(timeout=1) as c:
        for p in procs:
            if not p.proc.alive():
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                out[p.node_id] = (await c.get(f"{p.url}/v1/shards")).json()
    return out


async def converged(procs: list[AllocatorProcess], live: list[AllocatorProcess], within_s: float = 30.0) -> float:
    """Wait until every live replica's map shows the assignment over ``live``; the seconds it took."""
    want = assignment(SHARDS, {p.node_id for p in live})
    t0 = time.monotonic()

    async def done() -> bool:
        got = await maps(live)
        return len(got) == len(live) and all([sl["nodeId"] for sl in m["leaders"]] == [want[s] for s in range(SHARDS)]
                                              for m in got.values())
    assert await await_until(done, within_s=within_s, interval=0.05), \
        f"the live replicas' maps never showed {want}"
    return time.monotonic() - t0


async def record_leaders(store: EtcdStore, prefix: str, w: HistoryWriter, stop: asyncio.Event) -> None:
    """Every shard's leader term as etcd shows it, while the run lasts (the checker needs the terms)."""
    seen: set[tuple[int, int]] = set()
    while not stop.is_set():
        with contextlib.suppress(Exception):
            for rec in await read_leaders(store, prefix):
                if (rec.shard, rec.epoch) not in seen:
                    seen.add((rec.shard, rec.epoch))
                    w.write(rec)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def test_kill_rejoin_and_leave_under_load_pass_the_checker(three: list[AllocatorProcess], prefix: str,
                                                                 etcd_cluster: EtcdCluster, etcd_reader: EtcdStore,
                                                                 tmp_path: Path) -> None:
    await converged(three, three)
    per = spread(assignment(SHARDS, set(NODES)))
    assert all(14 <= n <= 30 for n in per.values()), per  # each leads about a third
    history = tmp_path / "history.jsonl"
    with HistoryWriter(history) as w:
        w.write(Meta(scenario="allocator-shards", seed=1, started_at_ms=now_ms(), shards=SHARDS))
        stop = asyncio.Event()
        watcher = asyncio.create_task(record_leaders(etcd_reader, prefix, w, stop))
        drivers = [LeaseDriver(("eu", "us")[i % 2], p.id, [a.url for a in three], w, want=4, interval_s=0.05,
                               replay_probability=0.2, replay_delay_ms=(0, 1500), timeout_s=1.0, seed=i,
                               run_id="shards") for i, p in enumerate(POOLS)]
        runs = [asyncio.create_task(d.run(60.0, max_requests=2_000)) for d in drivers]
        try:
            await asyncio.sleep(2.0)
            # SIGKILL the replica leading the most shards: no resignation, its lease expires
            victim = max(three, key=lambda p: per[p.node_id])
            victim.proc.kill()
            survivors = [p for p in three if p is not victim]
            moved_s = await converged(three, survivors)
            print(f"SIGKILL of {victim.node_id} ({per[victim.node_id]} shards): moved in {moved_s:.2f} s")
            # the lease outlives the kill by at most the TTL; then one poll (0.25 s) and a campaign:
            # about 2.3 s on an idle machine (printed above), but the lease's expiry in a loaded
            # etcd, the campaigns and the reading of the maps all slow down beside other work (4.2 s
            # seen beside two busy cores), so the bound has room for that; how fast a failover is
            # belongs to make bench, here it is that the shards move at the lease's expiry
            assert moved_s <= TTL_S + 4.0, moved_s
            await asyncio.sleep(1.0)
            victim.start()  # a join: the shards that hash to it are handed back
            await converged(three, three)
            await asyncio.sleep(1.0)
            leaver = survivors[0]
            leaver.stop()  # SIGTERM: a graceful leave revokes its lease, the others take over at once
            await converged(three, [p for p in three if p is not leaver])
            await asyncio.sleep(1.5)
        finally:
            for d in drivers:
                d.stop()
            stats = await asyncio.gather(*runs)
            stop.set()
            await watcher
        w.write_all(await read_back(etcd_cluster.endpoints, prefix))
    assert sum(s.grants for s in stats) > 100 and sum(s.replays for s in stats) > 0
    report = check(history, POOLS)
    print(report.render())
    assert report.ok, report.render()
    for name in ("granted_within_limit", "no_stale_epoch_commit", "no_double_grant",
                 "acknowledged_grants_persisted", "no_stale_epoch_accept"):
        assert report.verdict(name).checked, name
    epochs = {(rec.shard, rec.epoch) for rec in report_leaders(history)}
    assert len({s for s, _e in epochs}) == SHARDS and len(epochs) > SHARDS  # every shard led, many moved


def report_leaders(history: Path) -> list[Leader]:
    from chaos.history import read_history

    return [r for r in read_history(history) if isinstance(r, Leader)]


async def test_a_paused_replicas_shards_are_taken_over_and_its_grants_fenced(
        three: list[AllocatorProcess], prefix: str, etcd_reader: EtcdStore) -> None:
    await converged(three, three)
    want = assignment(SHARDS, set(NODES))
    pool = POOLS[0].id
    victim = next(p for p in three if p.node_id == want[shard_of(pool, SHARDS)])
    others = [p for p in three if p is not victim]
    async with httpx.AsyncClient(timeout=30) as c:
        ok = await c.post(f"{victim.url}/v1/leases", json=lease_body("pause-shard-0", pool, "eu", 3))
        assert ok.status_code == 200
        epoch = ok.json()["epoch"]
        victim.proc.signal(signal.SIGSTOP)
        try:
            stuck = [asyncio.create_task(c.post(f"{victim.url}/v1/leases",
                                                json=lease_body(f"pause-shard-1{i}", pool, "eu", 3)))
                     for i in range(4)]
            await asyncio.sleep(0.2)
            await converged(three, others)  # its membership lease expired: the others lead everything
            new_leader = next(p for p in others if p.node_id == assignment(SHARDS, {o.node_id for o in others})[
                shard_of(pool, SHARDS)])
            took = (await c.post(f"{new_leader.url}/v1/leases", json=lease_body("pause-shard-2", pool, "us", 3))).json()
            assert took["epoch"] > epoch
        finally:
            victim.proc.signal(signal.SIGCONT)
        answers = await asyncio.gather(*stuck)
        codes = [r.json()["type"].rsplit("/", 1)[1] for r in answers]
        # what it had accepted it tried to commit under its old epoch: refused by etcd
        assert all(r.status_code == 503 for r in answers) and "fenced" in codes, codes
        assert set(codes) <= {"fenced", "not-leader"}, codes
        await converged(three, three)  # it rejoins with a new lease; its shards are handed back
    grants = await etcd_grants(etcd_reader, prefix)
    assert {"pause-shard-0", "pause-shard-2"} <= set(grants)
    assert not {f"pause-shard-1{i}" for i in range(4)} & set(grants)  # nothing committed while deposed


async def test_the_agents_client_routes_each_pool_to_its_shard_leader(three: list[AllocatorProcess]) -> None:
    await converged(three, three)
    want = assignment(SHARDS, set(NODES))
    url_of = {p.node_id: p.url for p in three}
    client = AllocatorClient([p.url for p in three], attempt_timeout_s=2.0, deadline_s=10.0)
    try:
        for i, p in enumerate(POOLS):  # each first call may bounce once (not-leader names the leader)
            g = await client.lease(LeaseRequest(lease_id=f"route-proc-{i}", region="eu", pool=p.id, want=2))
            assert g.granted == 2
        assert client.routes.shards == SHARDS
        for p in POOLS:  # learned: each pool now goes straight to its shard's leader
            assert client.routes.url_for(p.id) == url_of[want[shard_of(p.id, SHARDS)]]
        # the agent's batch path: usage reports of every pool, one batch spanning leaders, split by leader
        reports = [UsageReport(lease_id=f"route-proc-{i}", region="eu", pool=p.id, spent=1) for i, p in enumerate(POOLS)]
        assert len(client.routes.split([r.pool for r in reports], "x")) > 1  # the batch spans leaders: it is split
        deadline = time.monotonic() + 15.0
        while True:  # usage is reported once a lease expired (a 409 before): ask until every one is past it
            results = await client.report_many(reports)
            if all(isinstance(r, UsageReceipt) for r in results) or time.monotonic() > deadline:
                break
            assert all(getattr(r, "code", "") == "conflict" for r in results if not isinstance(r, UsageReceipt)), results
            await asyncio.sleep(0.25)
        assert all(isinstance(r, UsageReceipt) for r in results), results  # each reached its shard's leader
        assert [r.lease_id for r in results] == [r.lease_id for r in reports]
    finally:
        await client.aclose()
