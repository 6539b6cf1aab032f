"""True concurrency: agents as real uvicorn processes, many simultaneous HTTP clients."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis, RedisCluster

from tests.support.agent import admit_body, agent_process
from tests.support.redis_buckets import bucket_tokens, set_bucket, tenant_key, user_key


async def burst(bases: list[str], bodies: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(bodies))
    clients = [httpx.AsyncClient(base_url=b, timeout=10, limits=limits) for b in bases]
    try:
        async def one(i: int, body: dict) -> dict:
            resp = await clients[i % len(clients)].post("/v1/admit", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()

        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    finally:
        for c in clients:
            await c.aclose()


@pytest.fixture
async def r(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_two_gateways_same_instant_exactly_one_admitted(tmp_path: Path, redis_url: str, policy_file, r):
    """The end-to-end trace of docs/invariants.md, step 7: U-17 has 1,000 millitokens; gateways A and B ask at once."""
    u17, atlas = user_key("atlas", "U-17", "read"), tenant_key("atlas")
    with agent_process(tmp_path / "a", redis_url, policy_file) as (a, _), \
            agent_process(tmp_path / "b", redis_url, policy_file) as (b, _):
        for round_ in range(5):
            await set_bucket(r, u17, 1_000)
            await set_bucket(r, atlas, 639_000)
            got = await burst([a, b], [admit_body(f"gw-a-{round_:04d}"), admit_body(f"gw-b-{round_:04d}")])
            assert sorted(d["allowed"] for d in got) == [False, True]
            loser = next(d for d in got if not d["allowed"])
            assert loser["retryAfterMs"] == 500 and loser["headers"]["Retry-After"] == "1"
            assert (await bucket_tokens(r, u17), await bucket_tokens(r, atlas)) == (0, 638_000)


async def test_many_concurrent_admits_from_several_agents_admit_exactly_l(tmp_path: Path, redis_url: str,
                                                                         policy_file, r):
    await set_bucket(r, user_key("atlas", "U-17", "read"), 20_000)  # refill frozen: L = 20 exactly
    await set_bucket(r, tenant_key("atlas", "export"), 1_000_000)
    with agent_process(tmp_path / "a", redis_url, policy_file) as (a, _), \
            agent_process(tmp_path / "b", redis_url, policy_file) as (b, _), \
            agent_process(tmp_path / "c", redis_url, policy_file) as (c, _):
        got = await burst([a, b, c], [admit_body(f"race-{i:05d}") for i in range(120)])
        allowed = sum(d["allowed"] for d in got)
        # a 503 is a decision the agent could not finish within its budget (shed before sending, or
        # its store answer came too late): its token may be spent, so it may stand for one of L
        unsure = [d for d in got if d["httpStatus"] == 503]
        breakdown = Counter((d["httpStatus"], d["reason"]) for d in got)
        assert allowed <= 20, breakdown  # never more than L
        assert allowed + len(unsure) >= 20, breakdown  # every token is accounted for
        assert all(d["fallback"] is False for d in got)
        assert await bucket_tokens(r, user_key("atlas", "U-17", "read")) < 1_000  # all L spent
        # concurrency cap: 3 in flight, however many race for it
        exports = await burst([a, b, c], [admit_body(f"race-export-{i:03d}", route="export") for i in range(30)])
        assert sum(d["allowed"] for d in exports) == 3
        assert {d["deniedScope"] for d in exports if not d["allowed"]} == {"concurrency"}
        assert await bucket_tokens(r, tenant_key("atlas", "export")) == 970_000
        # concurrent admits share pipelines: the batcher saw fewer pipelines than calls
        calls = pipelines = 0.0
        for base in (a, b, c):
            async with httpx.AsyncClient(base_url=base) as client:
                text = (await client.get("/metrics")).text
            values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith("leasehold_agent_batch_size_")}
            calls += values["leasehold_agent_batch_size_sum"]
            pipelines += values["leasehold_agent_batch_size_count"]
        # every call reached a pipeline except those shed before sending (some of the 503s above)
        assert 150 - len(unsure) <= calls <= 150, breakdown
        assert pipelines < calls


async def test_exactly_l_on_redis_cluster(tmp_path: Path, redis_cluster_url: str, policy_file):
    rc = RedisCluster.from_url(redis_cluster_url)
    try:
        await set_bucket(rc, user_key("atlas", "U-5", "read"), 20_000)
        url = redis_cluster_url.replace("redis://", "redis+cluster://")
        with agent_process(tmp_path / "a", url, policy_file) as (a, _), \
                agent_process(tmp_path / "b", url, policy_file) as (b, _):
            got = await burst([a, b], [admit_body(f"cl-race-{i:04d}", pid="U-5") for i in range(80)])
            assert sum(d["allowed"] for d in got) == 20
            mixed = await burst([a, b], [admit_body(f"cl-mix-{i:04d}", tenant=("atlas", "birch")[i % 2],
                                                    pid=f"U-{i}") for i in range(40)])
            assert all(d["allowed"] and not d["fallback"] for d in mixed)
    finally:
        await rc.aclose()
