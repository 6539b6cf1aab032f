"""Lease grants against a real 3-member etcd, allocator in-process (its real etcd client)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import in_process, lease_body, settings_for
from tests.support.waiting import await_until

from .conftest import TestClock, W
from .support import AllocatorProcess, assert_replay_of, etcd_grants, etcd_windows


async def test_concurrent_grants_never_exceed_g(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                etcd_reader: EtcdStore, tmp_path: Path) -> None:
    g = 1_000
    bundle = make_bundle(Pool(id="scarce", window_ms=W, limit=g, chunk_min=1, chunk_max=40))
    proc = AllocatorProcess(tmp_path, etcd_cluster, bundle, prefix, "solo").start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert await await_until(lambda: (proc.leader_info() or {}).get("isSelf"), within_s=20), \
                proc.proc.tail()
            rnd = random.Random(7)

            async def region_client(region: str, n: int) -> list[int]:
                got = []
                for i in range(n):
                    body = lease_body(f"{region}-lease-{i:04d}", "scarce", region, rnd.randint(1, 60),
                                      rnd.randint(0, 20))
                    for _ in range(5):  # a retriable 503 (etcd slow under load) is retried with the same id
                        r = await client.post(f"{proc.url}/v1/leases", json=body)
                        if r.status_code != 503 or not r.json().get("retriable"):
                            break
                        await asyncio.sleep(0.2)
                    assert r.status_code == 200, r.text
                    got.append(r.json()["granted"])
                return got

            # concurrent duplicates of one id: one debit, one answer (shared while queued, else replayed)
            dup = await asyncio.gather(*(client.post(f"{proc.url}/v1/leases", json=lease_body(
                "dup-lease-0001", "scarce", "eu", 1)) for _ in range(10)))
            # a replay answers the stored grant with ttlMs/startsInMs recomputed for its own answer time
            # (only ever shorter, allocator README): on a busy machine the answers are milliseconds apart
            timing = ("replayed", "ttlMs", "startsInMs")
            bodies = [{k: v for k, v in d.json().items() if k not in timing} for d in dup]
            assert all(b == bodies[0] for b in bodies)
            assert bodies[0]["granted"] == 1
            first = min(d.json()["ttlMs"] for d in dup if not d.json()["replayed"])
            assert all(d.json()["ttlMs"] <= first for d in dup)
            # 12 concurrent clients (4 per region) asking for far more than G in total
            tasks = [region_client(f"{reg}", 25) for reg in ("eu", "us", "ap")]
            tasks += [region_client(f"{reg}{k}", 25) for reg in ("eu", "us", "ap") for k in range(3)]
            results = await asyncio.gather(*tasks)
            answered = sum(sum(x) for x in results) + 1
            text = (await client.get(f"{proc.url}/metrics")).text
    finally:
        proc.stop()
    windows = await etcd_windows(etcd_reader, prefix, "scarce")
    grants = await etcd_grants(etcd_reader, prefix)
    assert len(grants) == 12 * 25 + 1
    for k, state in windows.items():
        in_window = [rec.grant.granted for rec in grants.values() if rec.grant.window.index == k]
        assert sum(in_window) == state.total_granted == g - state.remaining
        assert sum(in_window) <= g
    assert answered == sum(rec.grant.granted for rec in grants.values())
    assert answered <= g * len(windows)
    # grants were grouped: fewer transactions than grants
    txns = float(text.split("leasehold_allocator_grants_per_txn_count ")[1].split()[0])
    assert txns < 12 * 25


async def test_retry_returns_identical_grant_and_conflicting_reuse_is_409(etcd_cluster: EtcdCluster, make_bundle,
                                                                         prefix: str, etcd_reader: EtcdStore, clock: TestClock) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=500, chunk_max=100),
                         Pool(id="p2", window_ms=W, limit=500, chunk_max=100))
    clock.place_in_window(W, 1_000)  # the whole test runs inside one window
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        first = (await client.post("/v1/leases", json=lease_body("retry-lease-1", "p1", "eu", 70))).json()
        again = await client.post("/v1/leases", json=lease_body("retry-lease-1", "p1", "eu", 70))
        assert again.status_code == 200
        assert_replay_of(again.json(), first)
        assert first["replayed"] is False and first["granted"] == 70
        # the same id for another pool of the same region is a conflict, and debits nothing
        r = await client.post("/v1/leases", json=lease_body("retry-lease-1", "p2", "eu", 5))
        assert r.status_code == 409 and r.headers["content-type"].startswith("application/problem+json")
        assert "region" not in r.json()["detail"]
        # lease ids are per region: another region's request with the same id is its own lease
        other = await client.post("/v1/leases", json=lease_body("retry-lease-1", "p1", "us", 5))
        assert other.status_code == 200 and other.json()["granted"] == 5 and other.json()["region"] == "us"
        r = await client.post("/v1/leases", json=lease_body("retry-lease-2", "p1", "eu", 30))
        assert r.json()["granted"] == 30
        stored = (await client.get("/v1/leases/retry-lease-2?region=eu")).json()
        assert stored["grant"]["granted"] == 30
        view = (await client.get("/v1/pools/p1")).json()
        text = (await client.get("/metrics")).text
        assert 'leasehold_allocator_grants_total{pool="p1",region="eu"} 2.0' in text
        assert 'leasehold_allocator_granted_tokens_total{pool="p1",region="eu"} 100.0' in text
        assert 'leasehold_allocator_replayed_grants_total{pool="p1"} 1.0' in text  # only the HTTP retry
        assert "leasehold_allocator_is_leader 1.0" in text
        assert 'leasehold_allocator_etcd_request_seconds_count{op="txn"}' in text
    windows = await etcd_windows(etcd_reader, prefix, "p1")
    (state,) = windows.values()
    assert state.remaining == 500 - 100 - 5 and view["remaining"] == 395  # eu's 70 + 30, us's own 5
    assert state.leases == {"eu": 2, "us": 1}
    assert (await etcd_windows(etcd_reader, prefix, "p2")) == {}


async def test_a_reused_lease_id_with_other_content_is_409_and_debits_nothing(
        etcd_cluster: EtcdCluster, make_bundle, prefix: str, etcd_reader: EtcdStore, clock: TestClock) -> None:
    """I17: the same lease id with another ``want``, ``demand`` or ``window`` is a 409 (a buggy or
    hostile agent reusing an id learns it), whether the first request is stored or still queued;
    the identical body is a replay. Nothing more is debited either way."""
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=500, chunk_max=100, prefetch_ms=W - 1))
    clock.place_in_window(W, 1_000)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        first = (await client.post("/v1/leases", json=lease_body("reuse-lease-1", "p1", "eu", 40, demand=3))).json()
        assert first["granted"] == 40
        for other in (lease_body("reuse-lease-1", "p1", "eu", 41, demand=3),
                      lease_body("reuse-lease-1", "p1", "eu", 40, demand=4),
                      lease_body("reuse-lease-1", "p1", "eu", 40, demand=3, window="next")):
            r = await client.post("/v1/leases", json=other)
            assert r.status_code == 409, r.text
            assert r.headers["content-type"].startswith("application/problem+json")
        again = await client.post("/v1/leases", json=lease_body("reuse-lease-1", "p1", "eu", 40, demand=3))
        assert_replay_of(again.json(), first)
        # concurrent: the first queued, the others join it while queued or find its record
        answers = await asyncio.gather(
            client.post("/v1/leases", json=lease_body("reuse-lease-2", "p1", "eu", 10)),
            *(client.post("/v1/leases", json=lease_body("reuse-lease-2", "p1", "eu", 20)) for _ in range(5)))
        assert answers[0].status_code == 200 and answers[0].json()["granted"] == 10
        assert [a.status_code for a in answers[1:]] == [409] * 5
    (state,) = (await etcd_windows(etcd_reader, prefix, "p1")).values()
    assert state.total_granted == 50 == 500 - state.remaining


async def test_expiry_never_passes_the_window_end(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                  clock: TestClock) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=500, lease_ttl_ms=15_000, chunk_max=100,
                              prefetch_ms=2_000))
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        now = clock.place_in_window(W, W - 5_000, freeze=True)
        end = (now // W + 1) * W
        r = (await client.post("/v1/leases", json=lease_body("clamp-lease-1", "p1", "eu", 10))).json()
        assert r["window"]["endMs"] == end
        assert r["expiresAtMs"] == end and r["ttlMs"] == 5_000 and r["startsInMs"] == 0
        # early in a window the full TTL applies
        now = clock.place_in_window(W, 1_000, freeze=True)
        r = (await client.post("/v1/leases", json=lease_body("clamp-lease-2", "p1", "eu", 10))).json()
        assert r["expiresAtMs"] == now + 15_000 <= r["window"]["endMs"]
        # prefetch: refused far from the boundary, granted from window k+1 close to it
        bad = await client.post("/v1/leases", json=lease_body("clamp-lease-3", "p1", "eu", 10, window="next"))
        assert bad.status_code == 409 and "prefetch" in bad.json()["detail"]
        now = clock.place_in_window(W, W - 1_500, freeze=True)
        r = (await client.post("/v1/leases", json=lease_body("clamp-lease-4", "p1", "eu", 10, window="next"))).json()
        assert r["window"]["index"] == now // W + 1
        assert r["startsInMs"] == 1_500
        assert r["expiresAtMs"] == r["window"]["startMs"] + 15_000 <= r["window"]["endMs"]
        assert r["ttlMs"] == r["expiresAtMs"] - now


async def test_fair_share_leaves_no_region_starved(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                   etcd_reader: EtcdStore, clock: TestClock) -> None:
    bundle = make_bundle(Pool(id="tight", window_ms=W, limit=90, chunk_min=1, chunk_max=60))
    regions = ["eu", "us", "ap"]
    clock.place_in_window(W, 1_000)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as client:
        # everyone announces itself first (small asks), then the greedy region asks big and often
        for reg in regions:
            r = await client.post("/v1/leases", json=lease_body(f"fair-{reg}-0000", "tight", reg, 1, demand=50))
            assert r.json()["granted"] == 1
        got = {reg: 1 for reg in regions}
        for i in range(1, 6):
            rs = await asyncio.gather(*(client.post("/v1/leases", json=lease_body(
                f"fair-{reg}-{i:04d}", "tight", reg, 60 if reg == "eu" else 10, demand=50)) for reg in regions))
            for reg, r in zip(regions, rs, strict=True):
                got[reg] += r.json()["granted"]
    (state,) = (await etcd_windows(etcd_reader, prefix, "tight")).values()
    assert sum(got.values()) == 90 - state.remaining <= 90
    assert all(got[reg] >= 10 for reg in regions), got  # no region starved by the greedy one
    assert got["eu"] < 60  # the greedy region could not take its full chunk from a scarce pool
