"""Two ``python -m allocator`` replicas as real subprocesses over a real 3-member etcd: leader
kill (SIGKILL) and leader pause (SIGSTOP past its etcd lease)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import lease_body
from tests.support.waiting import await_until
from tests.support.windows import clear_of_window_edges

from .conftest import W
from .support import AllocatorProcess, assert_replay_of, etcd_grants, etcd_windows


@pytest.fixture
def replicas(tmp_path: Path, etcd_cluster: EtcdCluster, make_bundle, prefix: str) -> Iterator[list[AllocatorProcess]]:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=1_000, chunk_max=100))
    procs = [AllocatorProcess(tmp_path, etcd_cluster, bundle, prefix, f"node{i}", election_ttl_s=2)
             for i in range(2)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def leader_of(procs: list[AllocatorProcess], exclude: AllocatorProcess | None = None,
                    ) -> tuple[AllocatorProcess, int]:
    found: list[tuple[AllocatorProcess, int]] = []

    async def check() -> bool:
        async with httpx.AsyncClient(timeout=2) as c:
            for p in procs:
                if p is exclude or not p.proc.alive():
                    continue
                try:
                    info = (await c.get(f"{p.url}/v1/leader")).json()
                except httpx.HTTPError:
                    continue
                if info["isSelf"]:
                    found.append((p, info["epoch"]))
                    return True
        return False
    assert await await_until(check, within_s=30, interval=0.1), "no replica became leader"
    return found[-1]


async def test_retry_after_leader_kill_returns_the_identical_grant(replicas: list[AllocatorProcess], prefix: str,
                                                                   etcd_reader: EtcdStore) -> None:
    leader, epoch = await leader_of(replicas)
    # a grant's ttl is clamped to its window's end; granted in the window's tail, the replay's would
    # reach 0 and could not show that the failover's seconds were taken off
    await clear_of_window_edges(W, before_ms=15_000)
    (other,) = [p for p in replicas if p is not leader]
    async with httpx.AsyncClient(timeout=10) as c:
        # the follower names the leader
        r = await c.post(f"{other.url}/v1/leases", json=lease_body("kill-lease-1", "p1", "eu", 60))
        assert r.status_code == 503 and r.json()["leader"] == leader.url
        first = (await c.post(f"{leader.url}/v1/leases", json=lease_body("kill-lease-1", "p1", "eu", 60))).json()
        answered = time.monotonic()
        assert first["granted"] == 60 and first["epoch"] == epoch
        leader.proc.kill()  # SIGKILL: no resignation, the leader key expires with its etcd lease
        new_leader, new_epoch = await leader_of(replicas, exclude=leader)
        assert new_leader is other and new_epoch > epoch
        asked = time.monotonic()
        again = await c.post(f"{other.url}/v1/leases", json=lease_body("kill-lease-1", "p1", "eu", 60))
        assert again.status_code == 200
        assert_replay_of(again.json(), first)  # the same grant, its old epoch included
        # the failover took about a second or more (the leader key outlives the killed leader until its
        # 2 s etcd lease runs out); the replay's ttl is what is left of the stored expiry, less at least
        # the time measured here, not the stored ttl again
        passed_ms = int((asked - answered) * 1000)
        assert again.json()["ttlMs"] <= max(0, first["ttlMs"] - passed_ms) + 1  # + 1: ms rounding
        fresh = (await c.post(f"{other.url}/v1/leases", json=lease_body("kill-lease-2", "p1", "eu", 40))).json()
        assert fresh["epoch"] == new_epoch and fresh["granted"] == 40
        if fresh["window"] == first["window"]:
            assert fresh["remaining"] == 1_000 - 60 - 40  # the new leader continued from etcd's state
    windows = (await etcd_windows(etcd_reader, prefix, "p1")).values()  # one, or two if a boundary passed
    assert sum(w.total_granted for w in windows) == 100
    assert all(w.remaining == w.limit - w.total_granted for w in windows)


async def test_paused_leader_cannot_commit_after_resume(replicas: list[AllocatorProcess], prefix: str,
                                                        etcd_reader: EtcdStore) -> None:
    leader, epoch = await leader_of(replicas)
    (other,) = [p for p in replicas if p is not leader]
    async with httpx.AsyncClient(timeout=30) as c:
        ok = await c.post(f"{leader.url}/v1/leases", json=lease_body("pause-lease-0", "p1", "eu", 10))
        assert ok.status_code == 200
        leader.proc.signal(signal.SIGSTOP)
        try:
            # requests reach the paused leader (the kernel accepts the connections) and wait
            stuck = [asyncio.create_task(c.post(f"{leader.url}/v1/leases",
                                                json=lease_body(f"pause-lease-1{i}", "p1", "eu", 10)))
                     for i in range(4)]
            await asyncio.sleep(0.2)
            new_leader, new_epoch = await leader_of(replicas, exclude=leader)
            assert new_leader is other and new_epoch > epoch
            took = await c.post(f"{other.url}/v1/leases", json=lease_body("pause-lease-2", "p1", "us", 20))
            assert took.json()["epoch"] == new_epoch
        finally:
            leader.proc.signal(signal.SIGCONT)
        answers = await asyncio.gather(*stuck)
        assert all(r.status_code == 503 for r in answers), [r.text for r in answers]
        codes = [r.json()["type"].rsplit("/", 1)[1] for r in answers]
        # what the resumed leader had accepted it tried to commit, and the epoch compare refused
        # it; requests read after it noticed the loss are refused as not-leader
        assert "fenced" in codes and set(codes) <= {"fenced", "not-leader"}, codes
        metrics = (await c.get(f"{leader.url}/metrics")).text
        fenced = float(metrics.split("\nleasehold_allocator_fenced_total ")[1].split()[0])
        assert 1 <= fenced <= codes.count("fenced")  # one refused txn per group of accepted requests
        # once resumed the old leader knows it is a follower and names the new leader
        assert await await_until(lambda: _follows(leader, other.url), within_s=10), \
            "the resumed old leader does not follow the new one"
    grants = await etcd_grants(etcd_reader, prefix)
    assert set(grants) == {"pause-lease-0", "pause-lease-2"}  # nothing committed by the paused leader
    assert grants["pause-lease-2"].grant.epoch > grants["pause-lease-0"].grant.epoch
    windows = (await etcd_windows(etcd_reader, prefix, "p1")).values()
    assert sum(w.total_granted for w in windows) == 30
    assert all(w.remaining == w.limit - w.total_granted for w in windows)


def _follows(proc: AllocatorProcess, leader_url: str) -> bool:
    info = proc.leader_info()
    return info is not None and not info["isSelf"] and info["url"] == leader_url
