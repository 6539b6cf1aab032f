"""Regional Redis lost under an agent that spends allocator leases (docs/bound.md): a Redis
stop is answered per rule ``failMode`` with the stated bound — local_bounded rules from the
in-process fallback (a tenant pool rule: ``fallbackPerRegion`` per pool window and agent; a
user rule: its fallback bucket's capacity), closed rules 503 — and a Redis restart (script cache
and all state lost) is survived: scripts reload on NOSCRIPT, leases are bought again, and
decisions are normal again, with no 5xx from the agent at any point."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from redis.asyncio import Redis

from kernel.bundle import Pool, make_rule
from tests.support.agent import admit_body
from tests.support.policies import write_pools
from tests.support.windows import clear_of_window_edges, wait_for_window_start

from .conftest import admit, metric, pool_rule, user_rule, wall_ms

ATLAS = Pool(id="atlas-w", window_ms=20_000, limit=1_000, lease_ttl_ms=10_000, chunk_min=10, chunk_max=50,
             fallback_per_region=4, prefetch_ms=200)
BIRCH = Pool(id="birch-w", window_ms=20_000, limit=1_000, lease_ttl_ms=10_000, chunk_min=10, chunk_max=50,
             fallback_per_region=4, prefetch_ms=200)
EXPORT = make_rule(id="export-closed", scope="tenant", route_group="export", algorithm="token_bucket",
              capacity_millis=100_000, refill_millis=100_000, period_ms=60_000, cost_millis=1_000,
              fail_mode="closed", closed_retry_after_ms=3_000)


async def test_redis_stop_and_restart_per_fail_mode(tmp_path: Path, topology_factory):
    rules = [user_rule(), EXPORT, pool_rule("atlas", ATLAS.id), pool_rule("birch", BIRCH.id, fail_mode="closed")]
    topo = topology_factory(write_pools(tmp_path / "bundle.json", [ATLAS, BIRCH], rules), regions=("eu",))
    url = topo.agent_urls["eu"][0]
    redis = topo.redis["eu"]
    async with httpx.AsyncClient(timeout=10) as client:
        async def one(tenant: str, user: str, route: str = "read") -> dict:
            return (await admit(client, url, "eu", admit_body(tenant=tenant, pid=user, route=route))).d

        for tenant in ("atlas", "birch"):
            d = await one(tenant, "U-0")
            assert d["allowed"] and not d["fallback"]
        r = Redis.from_url(redis.url)
        run_id = (await r.info("server"))["run_id"]
        await r.aclose()
        # ---- Redis stopped
        redis.stop()
        # closed rules: 503 with the policy's Retry-After, nothing admitted
        for route, tenant in (("export", "atlas"), ("read", "birch")):
            d = await one(tenant, "U-1", route)
            assert (d["allowed"], d["httpStatus"], d["reason"]) == (False, 503, "LIMITER_UNAVAILABLE")
        closed = await one("atlas", "U-1", "export")  # the policy's 3 s, spread upward by the jitter
        assert closed["retryAfterMs"] == 3_000
        assert closed["headers"]["Retry-After"] == str(-(-(3_000 + closed["retryJitterMs"]) // 1000)) in ("3", "4")
        # the tenant pool's allowance below is counted per pool window (20 s, Unix-time-aligned, as the
        # allocator numbers them): the 15 requests that spend it must fall in one window, clear of its
        # edges by more than the agent's uncertainty of the allocator's clock. A run they straddled
        # (begun near an edge, or a stall past one) is not judged: it is run again in a fresh window
        # with fresh users, bounded
        W = ATLAS.window_ms
        await clear_of_window_edges(W, before_ms=3_000, after_ms=500)
        for attempt in range(3):
            first_ms = wall_ms()
            # local_bounded, one user: that user's fallback bucket (capacity 3) bounds it
            mine = [await one("atlas", f"U-{5 + 1_000 * attempt}") for _ in range(5)]
            # local_bounded, many users: the tenant pool's per-agent allowance (4 per pool window), of
            # which U-5 spent 3, bounds the tenant
            many = [await one("atlas", f"U-{i + 1_000 * attempt}") for i in range(10, 20)]
            if (first_ms - 500) // W == (wall_ms() + 500) // W:
                break
            await wait_for_window_start(W, after_ms=500)
        else:
            raise AssertionError("in 3 pool windows, 15 requests never fell in one window (machine too slow)")
        assert all(d["fallback"] for d in mine)
        assert [d["allowed"] for d in mine] == [True] * 3 + [False] * 2
        assert all(d["deniedScope"] == "user" and d["httpStatus"] == 429 for d in mine[3:])
        assert all(d["fallback"] for d in many)
        assert [d["allowed"] for d in many] == [True] + [False] * 9
        assert all(d["deniedScope"] == "tenant" and d["httpStatus"] == 429 and d["retryAfterMs"] > 0
                   for d in many[1:])
        assert await metric(url, "leasehold_agent_degraded_decisions_total", fail_mode="closed") >= 2
        assert await metric(url, "leasehold_agent_degraded_decisions_total", fail_mode="local_bounded") >= 10
        # ---- Redis back, empty: no scripts, no buckets, no leased balances
        redis.start()
        r = Redis.from_url(redis.url)
        try:
            assert (await r.info("server"))["run_id"] != run_id  # a new server: no scripts, no state
            # the shard's breaker is open for a moment (1 s), then probes: poll, bounded
            d: dict = {}
            for i in range(60):
                d = await one("atlas", f"U-{40 + i}")
                if d["allowed"] and not d["fallback"]:
                    break
                await asyncio.sleep(0.1)
            assert d["allowed"] and not d["fallback"]
            # from then on: decisions from the shared Redis again (scripts reloaded, a new lease bought)
            after = [await one("atlas", f"U-{i}") for i in range(200, 210)]
            assert not any(x["fallback"] for x in after) and sum(x["allowed"] for x in after) >= 8
            # a burst may briefly outrun the first new lease: a plain 429 with a short hint, never a 5xx
            assert all(x["httpStatus"] == 429 and x["retryAfterMs"] < 1_000 for x in after if not x["allowed"])
            assert await metric(url, "leasehold_agent_breaker_state") == 0
            assert await r.dbsize() > 0  # scripts ran again (reloaded on NOSCRIPT) and wrote state
            for tenant, route in (("atlas", "export"), ("birch", "read")):
                d = await one(tenant, "U-2", route)
                assert d["allowed"] and not d["fallback"]
        finally:
            await r.aclose()
        # ---- a quick restart (SIGTERM, start on the same port): the script cache is gone again
        redis.restart()
        d = {}
        for i in range(60):
            d = await one("atlas", f"U-{300 + i}")
            if d["allowed"] and not d["fallback"]:
                break
            await asyncio.sleep(0.1)
        assert d["allowed"] and not d["fallback"]
        assert (await one("atlas", "U-400", "export"))["allowed"]
        ready = await client.get(url + "/readyz")
        assert ready.status_code == 200
