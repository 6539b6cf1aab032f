"""The etcd adapter against a real cluster: endpoint failover, error translation, lease buckets."""

from __future__ import annotations

import pytest

from kernel.errors import StoreUnavailable
from kernel.etcd_store import EtcdStore, LeaseBuckets, txn_revision
from leasehold.procs import EtcdCluster, free_port

from .helpers import unique_prefix


async def test_moves_past_a_dead_endpoint(etcd_cluster: EtcdCluster) -> None:
    seen: list[str] = []
    store = EtcdStore(f"127.0.0.1:{free_port()}," + ",".join(etcd_cluster.endpoints), timeout_s=1,
                      observe=lambda op, s: seen.append(op))
    key = (unique_prefix() + "k").encode()
    try:
        t = store.t
        ok, resp = await store.txn([t.version(key) == 0], [t.put(key, b"v1")])
        assert ok and txn_revision(resp) > 0
        kv = await store.get(key)
        assert kv is not None and kv.value == b"v1" and kv.mod_revision == txn_revision(resp)
        ok, _ = await store.txn([t.version(key) == 0], [t.put(key, b"v2")])
        assert not ok  # the compare protects a retried write
        assert (await store.get_many([key]))[key].value == b"v1"
        assert "txn" in seen
    finally:
        await store.close()


async def test_all_endpoints_dead_is_store_unavailable() -> None:
    store = EtcdStore(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailable) as e:
            await store.get(b"/x")
        assert e.value.retriable and e.value.status == 503
    finally:
        await store.close()


async def test_lease_buckets_share_one_lease(etcd_cluster: EtcdCluster) -> None:
    store = EtcdStore(",".join(etcd_cluster.endpoints), timeout_s=2)
    try:
        buckets = LeaseBuckets(store, bucket_ms=10_000)
        now = 1_000_000_000
        a = await buckets.lease_for(now + 61_000, now)
        b = await buckets.lease_for(now + 65_000, now)
        c = await buckets.lease_for(now + 75_000, now)
        assert a == b != c
        ttl = await store.refresh(a)
        assert 61 <= ttl <= 70 + buckets.margin_s
        await store.revoke(a)
        await store.revoke(c)
    finally:
        await store.close()
