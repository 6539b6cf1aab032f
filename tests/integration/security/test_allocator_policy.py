"""The allocator follows the published bundle: pools switch to a strictly higher version;
lower versions and corrupt values are refused and counted; the last good pools stay."""

from __future__ import annotations

import msgspec

from kernel.bundle import Pool, encode_bundle, load_bundle_file, seal
from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore
from tests.support.allocator_app import in_process, lease_body, settings_for, unique_prefix
from tests.support.policies import write_pools
from tests.support.waiting import await_until


async def test_allocator_follows_published_pools(etcd_cluster, tmp_path):
    prefix = unique_prefix()
    path = write_pools(tmp_path / "b.json", [Pool(id="p1", window_ms=60_000, limit=100)])
    base = load_bundle_file(str(path))
    store = PolicyStore(EtcdStore(",".join(etcd_cluster.endpoints)), prefix)
    try:
        async with in_process(settings_for(etcd_cluster, path, prefix, policy_reread_ms=100)) as client:
            newer = seal(msgspec.structs.replace(base, bundle_version=2,
                                                 pools=[Pool(id="p1", window_ms=60_000, limit=7, chunk_max=5)]))
            await store.publish(encode_bundle(newer))
            assert await await_until(lambda: client.app_state.policy.bundle.bundle_version == 2), \
                client.app_state.policy.bundle.bundle_version
            pools = (await client.get("/v1/pools")).json()
            assert [(p["id"], p["limit"]) for p in pools] == [("p1", 7)]
            grant = (await client.post("/v1/leases", json=lease_body("lease-0000001", "p1", "eu", 50))).json()
            assert grant["granted"] <= 7
            await store.store.put(store.key, b'{"bundleVersion": 3, "garbage": true}')
            assert await await_until(lambda: 'leasehold_allocator_policy_reloads_total{outcome="invalid"} 1.0'
                                     in client.app_state.writer.metrics.render().decode()), \
                "the invalid bundle not counted"
            await store.store.put(store.key, encode_bundle(base))  # version 1 < 2
            assert await await_until(lambda: 'leasehold_allocator_policy_reloads_total{outcome="stale"} 1.0'
                                     in client.app_state.writer.metrics.render().decode()), \
                "the stale bundle not counted"
            assert client.app_state.policy.bundle.bundle_version == 2
            assert [(p["id"], p["limit"]) for p in (await client.get("/v1/pools")).json()] == [("p1", 7)]
    finally:
        await store.store.close()
