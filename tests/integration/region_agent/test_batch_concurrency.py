"""Batch endpoint order, coalescing, and exactly-L admits under concurrency (real Redis)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from tests.support.agent import admit_body
from tests.support.redis_buckets import set_bucket, user_key


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
