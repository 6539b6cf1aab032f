"""The same behaviour on a real 3-master Redis Cluster."""

from __future__ import annotations

import pytest
from redis.asyncio import RedisCluster

from tests.support.agent import admit_body, admit_json
from tests.support.redis_buckets import bucket_tokens, set_bucket, tenant_key, user_key


@pytest.fixture
async def rc(redis_cluster_url):
    client = RedisCluster.from_url(redis_cluster_url)
    yield client
    await client.aclose()


admit = admit_json


async def test_cluster_p_read_and_walkthrough(cluster_agent, rc):
    u17, atlas = user_key("atlas", "U-17", "read"), tenant_key("atlas")
    await set_bucket(rc, u17, 20_000)
    results = [await admit(cluster_agent, f"cl-read-{i:03d}") for i in range(21)]
    assert [d["allowed"] for d in results] == [True] * 20 + [False]
    assert results[-1]["retryAfterMs"] == 500 and results[-1]["headers"]["Retry-After"] == "1"
    await set_bucket(rc, u17, 20_000)
    await set_bucket(rc, atlas, 3_000)
    d = await admit(cluster_agent, "cl-walk-0003", cost=10)
    assert (d["allowed"], d["deniedScope"], d["retryAfterMs"]) == (False, "tenant", 420)
    assert await bucket_tokens(rc, u17) == 20_000


async def test_cluster_concurrency_and_idempotency(cluster_agent, rc):
    export = tenant_key("atlas", "export")
    await set_bucket(rc, export, 1_000_000)
    first = await admit(cluster_agent, "cl-r-e41", route="export")
    assert (await admit(cluster_agent, "cl-r-e41", route="export")) == first
    assert await bucket_tokens(rc, export) == 990_000
    for i in range(2):
        assert (await admit(cluster_agent, f"cl-export-{i}", route="export"))["allowed"] is True
    fourth = await admit(cluster_agent, "cl-export-4", route="export")
    assert fourth["deniedScope"] == "concurrency" and fourth["httpStatus"] == 429


async def test_cluster_batch_across_slots(cluster_agent, rc):
    # tenants atlas and birch hash to different slots; one batch answers both, in order
    items = [admit_body(f"cl-b-{i:04d}", tenant="atlas" if i % 2 else "birch", pid=f"U-{i}") for i in range(30)]
    resp = await cluster_agent.post("/v1/admit/batch", json={"requests": items})
    decisions = resp.json()["decisions"]
    assert [d["decisionId"] for d in decisions] == [i["requestId"] for i in items]
    assert all(d["allowed"] for d in decisions)
    assert {d["policyId"] for d in decisions} == {"read-user-v3"}
    # every birch item also spent its tenant bucket (refill during the test adds a few millitokens)
    assert 285_000 <= await bucket_tokens(rc, tenant_key("birch")) < 286_000
    assert 985_000 <= await bucket_tokens(rc, tenant_key("atlas")) < 986_000
