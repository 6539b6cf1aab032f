"""The regional Redis loses leased-balance state under a region that holds a lease (docs/bound.md:
never re-deposited). Real etcd, allocator, redis-server and agent processes.

* Restart with an RDB snapshot taken mid-lease: the lease comes back with an older ``spent`` count.
  It must not be spendable again (admitted <= G in the window), and closing it reports it fully
  spent (nothing is returned to the pool to be granted again); the tokens are counted as lost.
* Restart without persistence: the lease record is gone; closing it reports it fully spent too.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from kernel.bundle import Pool
from tests.support.agent import admit_body
from tests.support.policies import write_pools
from tests.support.waiting import await_until
from tests.support.windows import wait_for_window_start

from .conftest import admit, etcd_grants, metric, pool_rule, start_topology, wall_ms

# each region's lease lives to the window's end (lease_ttl_ms = window_ms): the lease held when the
# snapshot is taken is still the one held when Redis restarts, however slowly the requests before it
# are served (with a 3 s lease, 40 requests on a loaded machine outlived it: a new lease took over
# and requests were denied in between)
POOL = Pool(id="inc-w", window_ms=30_000, limit=50, lease_ttl_ms=30_000, chunk_min=50, chunk_max=50,
            fallback_per_region=0, prefetch_ms=1_000, active_horizon_ms=30_000)
LOST = Pool(id="lost-w", window_ms=30_000, limit=50, lease_ttl_ms=30_000, chunk_min=50, chunk_max=50,
            fallback_per_region=0, prefetch_ms=1_000, active_horizon_ms=30_000)


async def _until_served(client: httpx.AsyncClient, url: str, tenant: str, within_s: float = 15.0) -> dict:
    """After a Redis restart: poll until the agent answers from Redis again (breaker closed, scripts
    reloaded); returns that first answer (allowed or not)."""
    answers: list[dict] = []

    async def served() -> bool:
        answers.append((await admit(client, url, "eu", admit_body(tenant=tenant, pid="U-poll"))).d)
        return answers[-1]["httpStatus"] != 503
    assert await await_until(served, within_s, interval=0.1), answers[-1]
    return answers[-1]


async def _closed_grants(topo, pool: str, within_s: float = 15.0) -> list:
    grants: list = []

    async def closed() -> bool:
        grants[:] = [g for g in (await etcd_grants(topo)).values() if g.grant.pool == pool and g.grant.granted > 0]
        return bool(grants) and all(g.reported for g in grants)
    assert await await_until(closed, within_s, interval=0.2), [(g.grant.lease_id, g.reported) for g in grants]
    return grants


async def test_restored_or_lost_lease_records_count_as_fully_spent(tmp_path: Path):
    policy = write_pools(tmp_path / "bundle.json", [POOL, LOST], [pool_rule("atlas", POOL.id, fail_mode="closed"),
                                                                   pool_rule("birch", LOST.id, fail_mode="closed")])
    topo = start_topology(tmp_path / "topo", policy, regions=("eu",))
    try:
        url = topo.agent_urls["eu"][0]
        redis = topo.redis["eu"]
        W, G = POOL.window_ms, POOL.limit
        # the test needs ~10 s inside one 30 s window: start now if that fits, else at the next window
        k = wall_ms() // W
        if (k + 1) * W - wall_ms() < 18_000:
            k = await wait_for_window_start(W, after_ms=300)
        allowed = 0
        async with httpx.AsyncClient(timeout=10) as client:
            async def spend(n: int, tenant: str = "atlas", tries: int = 0) -> int:
                """Admitted of up to ``n + tries`` requests, stopping at ``n`` admitted."""
                ok = 0
                for _ in range(n + tries):
                    got = (await admit(client, url, "eu", admit_body(tenant=tenant))).allowed
                    ok += got
                    if ok == n:
                        break
                    if not got:  # e.g. the warm-up lease's tokens are on their way back to the pool
                        await asyncio.sleep(0.05)
                return ok

            allowed += await spend(10, tries=40)
            assert allowed == 10
            redis.cli("SAVE")  # a snapshot with atlas's lease at spent = 10, and no lease of birch yet
            allowed += await spend(30)
            assert allowed == 40
            assert await spend(10, "birch", tries=40) == 10
            # ---- killed and restarted from the snapshot: atlas's lease is back with spent = 10,
            # ---- birch's lease record is gone
            view = (await client.get(url + "/v1/leases")).json()
            held = {lease["leaseId"] for b in view["balances"] for lease in b["leases"]}
            assert len(held) >= 2, view
            redis.proc.kill()
            redis.start()
            first = await _until_served(client, url, "atlas")
            allowed += first["allowed"]
            allowed += await spend(40)
            assert wall_ms() // W == k, "the test outran its window"
            assert allowed <= G, f"window {k}: admitted {allowed} > G {G} after a restore from an older snapshot"
            closed_within_s = ((k + 1) * W - wall_ms()) / 1000 + 15  # the leases end with the window
            for pool in (POOL.id, LOST.id):
                grants = [g for g in await _closed_grants(topo, pool, closed_within_s) if g.grant.lease_id in held]
                assert grants
                for g in grants:  # reported fully spent: nothing returned to the pool to be granted again
                    assert g.spent == g.grant.granted and g.returned == 0, g
                assert await metric(url, "leasehold_agent_lease_lost_tokens_total", pool=pool) > 0
    finally:
        topo.stop()
