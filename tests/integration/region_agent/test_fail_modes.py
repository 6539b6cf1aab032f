"""Store loss (docs/invariants.md I10): a real redis-server is stopped under the agent."""

from __future__ import annotations

from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings


@pytest.fixture
async def stopped_store_agent(tmp_path: Path, policy_file: Path):
    server = RedisServer(tmp_path / "redis").start()
    app = create_app(make_settings(server.url, policy_file, decision_budget_ms=500), pepper=PEPPER)
    try:
        async with AsyncTestClient(app=app) as client:
            ok = await client.post("/v1/admit", json=admit_body("before-stop-1"))
            assert ok.json()["allowed"] is True and ok.json()["fallback"] is False
            assert (await client.get("/readyz")).status_code == 200
            health = await client.get("/v1/health/store")
            assert health.status_code == 200 and health.json() == {"store": "reachable", "scriptsLoaded": True,
                                                                   "breaker": "closed"}
            server.stop()
            yield client
    finally:
        server.stop()


async def test_fail_modes_with_redis_stopped(stopped_store_agent):
    agent = stopped_store_agent
    # readiness means "can answer": Redis down, the agent stays ready and answers by each rule's fail
    # mode (taking every agent out of its Service would hand the decision to the gateways instead);
    # the store's health is reported on its own endpoint
    ready = await agent.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    health = await agent.get("/v1/health/store")
    assert health.status_code == 503 and health.headers["content-type"].startswith("application/problem+json")
    assert health.json()["store"] == "unreachable"
    # P-EXPORT fails closed: 503 decision with the policy's conservative Retry-After
    d = (await agent.post("/v1/admit", json=admit_body("export-down-1", route="export"))).json()
    assert (d["allowed"], d["reason"], d["httpStatus"], d["fallback"]) == (False, "LIMITER_UNAVAILABLE", 503, False)
    assert d["headers"] == {"Retry-After": "5"} and d["problem"]["status"] == 503
    # P-READ degrades to the local bucket: capacity 5 (refill 0.25/s), fallback true
    results = [(await agent.post("/v1/admit", json=admit_body(f"read-down-{i:03d}"))).json() for i in range(8)]
    allowed = [d["allowed"] for d in results]
    assert all(d["fallback"] for d in results)
    assert allowed[:5] == [True] * 5
    assert allowed.count(True) <= 6  # bounded by the local bucket (one refill at most during the test)
    denied = [d for d in results if not d["allowed"]]
    assert denied and all(d["httpStatus"] == 429 and d["reason"] == "RATE_EXCEEDED" for d in denied)
    assert all(int(d["headers"]["Retry-After"]) >= 1 for d in denied)
    # a request that would be fine under the shared bucket never gets a 500 and is counted as degraded
    metrics = (await agent.get("/metrics")).text
    assert 'leasehold_agent_degraded_decisions_total{fail_mode="local_bounded",reason="STORE_UNREACHABLE"}' in metrics
    assert 'leasehold_agent_degraded_decisions_total{fail_mode="closed",reason="STORE_UNREACHABLE"}' in metrics


async def test_global_pool_without_a_chunk_fails_closed_when_the_store_is_down(tmp_path: Path, policy_file: Path):
    from kernel.bundle import Pool, make_rule
    from tests.support.policies import northstar, write_bundle

    base = northstar()
    pool = Pool(id="p-global", window_ms=60_000, limit=40_000, chunk_max=10)
    rule = make_rule(id="global-read", scope="global", route_group="read", algorithm="pool", pool="p-global",
                fail_mode="closed", closed_retry_after_ms=2_000)
    write_bundle(policy_file, base, rules=[*base.rules, rule], pools=[pool])
    server = RedisServer(tmp_path / "redis-pool").start()
    app = create_app(make_settings(server.url, policy_file, decision_budget_ms=500), pepper=PEPPER)
    try:
        async with AsyncTestClient(app=app) as agent:
            server.stop()
            d = (await agent.post("/v1/admit", json=admit_body("pool-down-1"))).json()
            assert (d["allowed"], d["reason"], d["deniedScope"], d["httpStatus"]) == (
                False, "LIMITER_UNAVAILABLE", "global", 503)
            assert d["headers"] == {"Retry-After": "2"}
            # anonymous login traffic has no global rule and still degrades to its local window
            anon = admit_body("anon-down-1", tenant=None, ptype="anonymous", pid="198.51.100.7", route="login",
                              api_key=None)
            a = (await agent.post("/v1/admit", json=anon)).json()
            assert a["allowed"] is True and a["fallback"] is True and a["headers"] == {}
    finally:
        server.stop()


async def test_a_stale_store_denial_does_not_answer_for_the_fallback(tmp_path: Path, policy_file: Path):
    """The negative cache after store loss (docs/invariants.md, the end-to-end trace, step 13 after step 7): a store denial whose exact
    hint has passed is probed by the next request; when the store is lost, the local fallback
    answers that probe, and the old denial must not then answer the following requests as a store
    decision (``fallback`` false, a 1 ms hint) while the probe's hold lasts."""
    import asyncio

    from redis.asyncio import Redis

    from tests.support.redis_buckets import set_bucket, user_key

    server = RedisServer(tmp_path / "redis").start()
    app = create_app(make_settings(server.url, policy_file, decision_budget_ms=500, negative_cache_ms=250),
                     pepper=PEPPER)
    r = Redis.from_url(server.url)
    try:
        async with AsyncTestClient(app=app) as agent:
            assert (await agent.post("/v1/admit", json=admit_body("neg-before-1"))).json()["allowed"]
            await set_bucket(r, user_key("atlas", "U-17", "read"), 0)
            denied = (await agent.post("/v1/admit", json=admit_body("neg-denied-1"))).json()
            assert denied["allowed"] is False and not denied["fallback"] and denied["retryAfterMs"] == 500
            assert len(app.state.agent.engine.negative) == 2  # held: its rule set for the exact hint, its key briefly
            await asyncio.sleep(0.6)  # the hint has passed: the next request probes the store
            await r.aclose()
            server.stop()
            reads = [(await agent.post("/v1/admit", json=admit_body(f"neg-down-{i:03d}"))).json() for i in range(7)]
            assert all(d["fallback"] for d in reads), [(d["allowed"], d["fallback"], d.get("retryAfterMs"))
                                                      for d in reads]
            assert [d["allowed"] for d in reads][:5] == [True] * 5  # the local bucket's capacity
    finally:
        server.stop()
