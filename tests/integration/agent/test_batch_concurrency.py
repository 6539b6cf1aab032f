"""Batch endpoint order, coalescing, and exactly-L admits under concurrency (real Redis)."""

from __future__ import annotations

import asyncio

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from region_agent.app import create_app

from .conftest import PEPPER, admit_body, make_settings, set_bucket, user_key


@pytest.fixture
async def r(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_batch_answers_in_order(agent, r):
    await set_bucket(r, user_key("atlas", "U-17", "read"), 20_000)
    items = []
    for i in range(25):
        items.append(admit_body(f"batch-u17-{i:03d}"))
        items.append(admit_body(f"batch-u99-{i:03d}", pid="U-99"))
    items.append(admit_body("batch-export-1", route="export"))
    resp = await agent.post("/v1/admit/batch", json={"requests": items})
    assert resp.status_code == 200, resp.text
    decisions = resp.json()["decisions"]
    assert [d["decisionId"] for d in decisions] == [it["requestId"] for it in items]
    u17 = [d["allowed"] for d in decisions[0:50:2]]
    u99 = [d["allowed"] for d in decisions[1:50:2]]
    assert u17 == [True] * 20 + [False] * 5
    assert u99.count(True) >= 20 and u99[:20] == [True] * 20
    assert decisions[-1]["allowed"] is True and decisions[-1]["policyId"] == "export-tenant"
    metrics = (await agent.get("/metrics")).text
    assert "leasehold_agent_batch_size_count" in metrics


async def test_empty_and_oversized_batches(agent):
    resp = await agent.post("/v1/admit/batch", json={"requests": []})
    assert resp.status_code == 200 and resp.json() == {"decisions": []}
    too_many = {"requests": [admit_body(f"many-{i:06d}") for i in range(1001)]}
    resp = await agent.post("/v1/admit/batch", json=too_many)
    assert 400 <= resp.status_code < 500
    assert resp.headers["content-type"].startswith("application/problem+json")


async def test_concurrent_admits_from_several_agents_admit_exactly_l(redis_url, policy_file, r):
    """Three agents (separate apps, pools and batchers) race 90 admits for one 20-token bucket."""
    await set_bucket(r, user_key("atlas", "U-17", "read"), 20_000)  # refill frozen: L = 20 exactly
    apps = [create_app(make_settings(redis_url, policy_file), pepper=PEPPER) for _ in range(3)]
    clients = [AsyncTestClient(app=a) for a in apps]
    for c in clients:
        await c.__aenter__()
    try:
        async def one(i: int) -> bool:
            resp = await clients[i % 3].post("/v1/admit", json=admit_body(f"race-{i:05d}"))
            assert resp.status_code == 200
            return resp.json()["allowed"]

        results = await asyncio.gather(*(one(i) for i in range(90)))
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    assert sum(results) == 20


async def test_coalesced_admits_share_pipelines(agent, r):
    await asyncio.gather(*(agent.post("/v1/admit", json=admit_body(f"co-{i:05d}", pid=f"U-{i}")) for i in range(40)))
    metrics = (await agent.get("/metrics")).text
    count = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("leasehold_agent_batch_size_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("leasehold_agent_batch_size_sum")))
    assert total == 40  # every script call went through the batcher
    assert count <= 40
