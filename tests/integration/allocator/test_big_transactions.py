"""Transactions as large as etcd allows: the limit read from etcd, many grants per transaction,
and an allocator configured above its etcd's limit (it learns the real one from the refusal and
grants everything anyway)."""

from __future__ import annotations

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import in_process, lease_body, settings_for
from tests.support.waiting import await_until

from .conftest import TestClock, W
from .support import etcd_grants, etcd_windows


def _metric(text: str, name: str) -> float:
    return float(text.split(name + " ")[1].split()[0])


async def _grant_all(client, reqs: list[dict]) -> list[dict]:
    r = await client.post("/v1/leases/batch", json={"requests": reqs})
    assert r.status_code == 200, r.text
    return r.json()["results"]


async def test_big_etcd_limit_carries_hundreds_of_grants_per_transaction(big_txn_etcd: EtcdCluster, make_bundle,
                                                                         prefix: str, clock: TestClock) -> None:
    pools = [Pool(id=f"t{i:03d}", window_ms=W, limit=100, chunk_max=50) for i in range(200)]
    bundle = make_bundle(*pools)
    reqs = [lease_body(f"bigtx-{i:05d}", f"t{i % 200:03d}", "eu", 30) for i in range(512)]
    clock.place_in_window(W, 1_000)
    reader = EtcdStore(",".join(big_txn_etcd.endpoints), timeout_s=5)
    try:
        async with in_process(settings_for(big_txn_etcd, bundle, prefix), clock=clock) as client:
            store = client.app_state.writer.store
            assert await await_until(lambda: store.txn_ops_known), "etcd's --max-txn-ops never learned"
            assert store.max_txn_ops == 1024  # read from etcd (--max-txn-ops 1024), not configured
            results = await _grant_all(client, reqs)
            text = (await client.get("/metrics")).text
        granted: dict[str, int] = {}
        for req, res in zip(reqs, results, strict=True):
            assert res["leaseId"] == req["leaseId"] and "granted" in res, res
            granted[req["pool"]] = granted.get(req["pool"], 0) + res["granted"]
        assert granted["t000"] == 30 * 3 and granted["t199"] == 30 * 2  # the same decisions as in 63-grant txns
        txns = _metric(text, "leasehold_allocator_grants_per_txn_count")
        # 512 grants queued at once, spread over the committer's slots in units of at least MIN_UNIT
        # (128; the first may go out alone while the rest arrive): at most five transactions, more
        # than 100 grants each on average - at etcd's default 128 ops a transaction holds at most 63
        assert txns <= 5 and 512 / txns > 100
        assert _metric(text, "leasehold_allocator_grants_per_txn_sum") == 512
        assert len(await etcd_grants(reader, prefix)) == 512
        for pool in ("t000", "t199"):
            (state,) = (await etcd_windows(reader, prefix, pool)).values()
            assert state.total_granted == granted[pool] == state.limit - state.remaining
    finally:
        await reader.close()


async def test_a_limit_configured_above_etcds_is_learned_from_the_refusal(etcd_cluster: EtcdCluster, make_bundle,
                                                                          prefix: str, clock: TestClock,
                                                                          etcd_reader: EtcdStore) -> None:
    pools = [Pool(id=f"m{i:03d}", window_ms=W, limit=100, chunk_max=50) for i in range(200)]
    bundle = make_bundle(*pools)
    reqs = [lease_body(f"misconf-{i:05d}", f"m{i % 200:03d}", "eu", 30) for i in range(400)]
    clock.place_in_window(W, 1_000)
    # etcd runs with its default 128 ops; the allocator was told 1024
    async with in_process(settings_for(etcd_cluster, bundle, prefix, etcd_max_txn_ops=1024), clock=clock) as client:
        results = await _grant_all(client, reqs)
        store = client.app_state.writer.store
        assert store.max_txn_ops == 128  # lowered on each refusal until etcd took the transactions
        text = (await client.get("/metrics")).text
    assert all(r.get("granted") == 30 for r in results), (len([r for r in results if r.get("granted") != 30]), [r for r in results if r.get("granted") != 30][:3])
    assert _metric(text, "leasehold_allocator_grants_per_txn_sum") == 400  # each grant committed once
    grants = await etcd_grants(etcd_reader, prefix)
    assert len(grants) == 400
    for pool in ("m000", "m199"):
        (state,) = (await etcd_windows(etcd_reader, prefix, pool)).values()
        assert state.total_granted == 60 == state.limit - state.remaining


async def test_one_hot_pool_in_big_transactions_never_exceeds_g(big_txn_etcd: EtcdCluster, make_bundle,
                                                                 prefix: str, clock: TestClock) -> None:
    bundle = make_bundle(Pool(id="hot", window_ms=W, limit=1_000, chunk_min=1, chunk_max=7))
    reqs = [lease_body(f"hot-{i:05d}", "hot", "eu us ap".split()[i % 3], 9, demand=i % 5) for i in range(500)]
    clock.place_in_window(W, 1_000)
    reader = EtcdStore(",".join(big_txn_etcd.endpoints), timeout_s=5)
    try:
        async with in_process(settings_for(big_txn_etcd, bundle, prefix), clock=clock) as client:
            assert await await_until(lambda: client.app_state.writer.store.txn_ops_known), \
                "etcd's --max-txn-ops never learned"
            results = await _grant_all(client, reqs)
        total = sum(r["granted"] for r in results)
        assert total == 1_000  # 500 x up to 7 asked: the pool is spent exactly, never beyond
        (state,) = (await etcd_windows(reader, prefix, "hot")).values()
        assert state.remaining == 0 and state.total_granted == 1_000
        assert sum(g.grant.granted for g in (await etcd_grants(reader, prefix)).values()) == 1_000
        remaining = [r["remaining"] for r in results]
        assert remaining == sorted(remaining, reverse=True)  # decided in request order on one state
    finally:
        await reader.close()
