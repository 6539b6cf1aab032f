"""A flood against an exhausted key stays off the shard (seed ch. 10 and 12)."""

from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from region_agent.app import create_app

from .conftest import PEPPER, admit_body, make_settings, set_bucket, user_key


async def evalsha_calls(r: Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_flood_on_an_exhausted_key_is_answered_locally(redis_url, policy_file):
    r = Redis.from_url(redis_url)
    app = create_app(make_settings(redis_url, policy_file, negative_cache_ms=250), pepper=PEPPER)
    try:
        async with AsyncTestClient(app=app) as agent:
            for i in range(20):  # drain U-17's P-READ bucket
                assert (await agent.post("/v1/admit", json=admit_body(f"drain-{i:04d}"))).json()["allowed"]
            # and freeze its refill: the flood must be denied however long a busy machine takes for it
            await set_bucket(r, user_key("atlas", "U-17", "read"), 0)
            first = (await agent.post("/v1/admit", json=admit_body("flood-00000"))).json()
            assert first["allowed"] is False and first["retryAfterMs"] > 0
            before = await evalsha_calls(r)
            flood = [(await agent.post("/v1/admit", json=admit_body(f"flood-{i:05d}"))).json() for i in range(1, 101)]
            after = await evalsha_calls(r)
            assert all(not d["allowed"] for d in flood)
            assert all(d["deniedScope"] == "user" and d["headers"]["Retry-After"] == "1" for d in flood)
            assert {d["decisionId"] for d in flood} == {f"flood-{i:05d}" for i in range(1, 101)}
            # a bucket's hint is exact: the cache holds the denial for it (500 ms), a few refreshes at most
            assert after - before <= 100 // 20
            metrics = (await agent.get("/metrics")).text
            hits = [line for line in metrics.splitlines() if line.startswith("leasehold_agent_negative_cache_hits_total")]
            assert hits and float(hits[0].split()[1]) >= 95
            # another user on the same route is not affected
            other = (await agent.post("/v1/admit", json=admit_body("other-00001", pid="U-18"))).json()
            assert other["allowed"] is True
    finally:
        await r.aclose()
