"""A region cannot take a pool by inflating its demand, on the real allocator (the app with its
etcd-backed writer, a real etcd cluster): a claim counts only up to twice the spend rate the
region's own usage reports show, and at least one full chunk per lease TTL, so in a low pool an
inflated claim without history gets the share of a modest one (allocator/README.md, "Semantics
worth knowing"). The reports' spent counts are kept per region in the window state in etcd (the
evidence)."""

from __future__ import annotations

from kernel.bundle import Pool
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import in_process, lease_body, settings_for

from .conftest import TestClock
from .support import etcd_windows

W = 60_000


async def test_inflated_demand_does_not_take_the_pool(etcd_cluster: EtcdCluster, make_bundle, prefix: str,
                                                      clock: TestClock, etcd_reader: EtcdStore) -> None:
    bundle = make_bundle(Pool(id="p1", window_ms=W, limit=300, lease_ttl_ms=5_000, chunk_max=100, chunk_min=1))
    # floor: one 100-token chunk per 5 s lease = 20 tokens/s may be claimed without history
    t0 = clock.place_in_window(W, 1_000, freeze=True)
    async with in_process(settings_for(etcd_cluster, bundle, prefix), clock=clock) as c:
        async def grant(lease_id: str, region: str, demand: int) -> dict:
            r = await c.post("/v1/leases", json=lease_body(lease_id, "p1", region, 100, demand=demand))
            assert r.status_code == 200, r.text
            return r.json()

        assert (await grant("eu-lease-0001", "eu", 20))["granted"] == 100
        assert (await grant("us-lease-0001", "us", 20))["granted"] == 100
        # 100 left for 2 active regions: the pool is low and shared by demand. us claims a
        # billion tokens a second with no history: it counts as 20/s, so us gets half, not all
        greedy = await grant("us-lease-0002", "us", 10**9)
        assert greedy["granted"] == 100 * 20 // (20 + 20), greedy
        assert (await grant("eu-lease-0002", "eu", 20))["granted"] == 25  # eu's half of what is left

        # usage reports after expiry: their spent counts are the evidence, kept in etcd
        clock.frozen = t0 + 6_000
        for lease_id, region, spent in (("eu-lease-0001", "eu", 10), ("us-lease-0001", "us", 100),
                                        ("us-lease-0002", "us", 50), ("eu-lease-0002", "eu", 0)):
            body = {"leaseId": lease_id, "region": region, "pool": "p1", "spent": spent}
            assert (await c.post(f"/v1/leases/{lease_id}/usage", json=body)).status_code == 200
        (state,) = (await etcd_windows(etcd_reader, prefix, "p1")).values()
        assert state.spent == {"eu": 10, "us": 150}
        # the next window reads that history: 150 tokens in ~61 s is ~3 tokens/s, below the floor,
        # so in the low tail us's huge claim still counts as 20/s against eu's 20/s
        clock.frozen = t0 + W
        assert (await grant("eu-lease-0003", "eu", 20))["granted"] == 100
        assert (await grant("us-lease-0003", "us", 20))["granted"] == 100
        again = await grant("us-lease-0004", "us", 10**9)
        assert again["granted"] == 50 and again["window"]["index"] == state.index + 1
