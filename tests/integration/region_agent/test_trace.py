"""The end-to-end trace of docs/invariants.md, steps 5-12, as far as one region runs them (real Redis)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from region_agent.decision.keys import KeyBuilder, hash_tag
from tests.support.agent import PEPPER, admit_json
from tests.support.redis_buckets import bucket_tokens, set_bucket, store_now_ms, tenant_key, user_key

U17_READ = user_key("atlas", "U-17", "read")
ATLAS = tenant_key("atlas")
EXPORT = tenant_key("atlas", "export")


@pytest.fixture
async def r(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


admit = admit_json


async def test_trace_steps_5_to_12(agent, r):
    # step 5: keys carry the tenant tag and a keyed principal hash (never the raw id)
    assert U17_READ.startswith("rl:v3:{t:atlas}:u:") and U17_READ.endswith(":read")
    assert "U-17" not in U17_READ and len(U17_READ.split(":")[5]) == 16
    assert hash_tag(U17_READ) == hash_tag(ATLAS) == "t:atlas"
    # step 6: fresh user bucket 20,000 -> 19,000; tenant 640,000 -> 639,000; TTLs 15 s and 65 s
    await set_bucket(r, ATLAS, 640_000)
    t0 = await store_now_ms(r)
    d = await admit(agent, "trace-step-6")
    assert d["allowed"] is True and d["remaining"] == 19 and d["policyVersion"] == 42
    assert await bucket_tokens(r, U17_READ) == 19_000
    assert await bucket_tokens(r, ATLAS) == 639_000
    user_ttl, tenant_ttl = await r.pttl(U17_READ), await r.pttl(ATLAS)
    passed = await store_now_ms(r) - t0  # since before the write: what the TTLs may have run down
    assert 14_000 - passed < user_ttl <= 15_000
    assert 64_000 - passed < tenant_ttl <= 65_000
    # step 7: U-17 has 1,000 left; A runs first (user 1,000 -> 0, tenant 639,000 -> 638,000), then B
    # (true concurrency between two agent processes: test_concurrency.py)
    await set_bucket(r, U17_READ, 1_000)
    await set_bucket(r, ATLAS, 639_000)
    a = await admit(agent, "trace-7-gw-a")
    b = await admit(agent, "trace-7-gw-b")
    assert (a["allowed"], b["allowed"]) == (True, False)
    assert (await bucket_tokens(r, U17_READ), await bucket_tokens(r, ATLAS)) == (0, 638_000)
    # step 8: B's answer: 429, Retry-After 1, RateLimit fields for U-17's own limit only
    loser = b
    assert loser["httpStatus"] == 429 and loser["retryAfterMs"] == 500
    assert loser["headers"] == {"Retry-After": "1", "RateLimit-Policy": '"read-user-v3";q=20;w=10',
                                "RateLimit": '"read-user-v3";r=0;t=1'}
    # step 9: one second later 2,000 millitokens came back: admitted, bucket 1,000
    await set_bucket(r, U17_READ, 0, age_ms=1_000)
    d = await admit(agent, "trace-step-9")
    assert d["allowed"] is True and d["remaining"] == 1
    # step 10: export with a 30 s decision record; 2 of 3 in flight -> 3 of 3
    for rid in ("export-run-1", "export-run-2"):
        assert (await admit(agent, rid, route="export"))["allowed"] is True
    await set_bucket(r, EXPORT, 1_000_000)
    first = await admit(agent, "r-e41-trace", route="export")
    assert first["allowed"] is True
    assert await r.zcard(EXPORT + ":cc") == 3
    dkey = f"rl:v3:{{t:atlas}}:d:{KeyBuilder(PEPPER).h('atlas', 'd', 'r-e41-trace')}"
    assert 25_000 < await r.pttl(dkey) <= 30_000
    # step 11: the retry with the same decision id replays the stored result: debited once
    again = await admit(agent, "r-e41-trace", route="export")
    assert again == first
    assert await bucket_tokens(r, EXPORT) == 990_000
    # step 12: a fourth concurrent export: 429 with the policy's Retry-After though the rate allows
    fourth = await admit(agent, "export-run-4", route="export")
    assert (fourth["allowed"], fourth["deniedScope"], fourth["headers"]["Retry-After"]) == (False, "concurrency",
                                                                                              "5")
    assert await bucket_tokens(r, EXPORT) == 990_000
