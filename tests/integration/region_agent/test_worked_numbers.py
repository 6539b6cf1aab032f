"""The worked numbers (docs/invariants.md) through the agent's HTTP API, on a real standalone
Redis and a real Redis Cluster (the ``topology`` fixture)."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, admit_json, make_settings
from tests.support.redis_buckets import bucket_tokens, set_bucket, store_now_ms, tenant_key, user_key

U17_READ = user_key("atlas", "U-17", "read")
ATLAS = tenant_key("atlas")


@pytest.fixture
def r(store_client):
    return store_client


@pytest.fixture
async def agent(topology, policy_file):
    async with AsyncTestClient(app=create_app(make_settings(topology.agent_url, policy_file), pepper=PEPPER)) as c:
        yield c


admit = admit_json


async def test_p_read_timeline(agent, r):
    await set_bucket(r, U17_READ, 20_000)  # a full bucket with the refill frozen
    results = [await admit(agent, f"read-{i:04d}") for i in range(21)]
    assert [d["allowed"] for d in results] == [True] * 20 + [False]
    assert [d["remaining"] for d in results[:20]] == list(range(19, -1, -1))
    denied = results[20]
    assert denied["retryAfterMs"] == 500
    assert denied["deniedScope"] == "user" and denied["reason"] == "RATE_EXCEEDED"
    assert denied["policyId"] == "read-user-v3" and denied["limit"] == 20 and denied["remaining"] == 0
    assert denied["httpStatus"] == 429
    assert denied["headers"]["Retry-After"] == "1"
    assert denied["headers"]["RateLimit-Policy"] == '"read-user-v3";q=20;w=10'
    assert denied["headers"]["RateLimit"] == '"read-user-v3";r=0;t=1'
    assert denied["problem"]["status"] == 429 and denied["problem"]["decisionId"] == "read-0020"
    # 300 ms later the bucket holds 600 millitokens: still denied, 200 ms to go
    await set_bucket(r, U17_READ, 600)
    d = await admit(agent, "read-0300ms")
    assert (d["allowed"], d["retryAfterMs"], d["headers"]["Retry-After"]) == (False, 200, "1")
    assert await bucket_tokens(r, U17_READ) == 600  # a denial writes nothing
    # 5 s after empty: 10 tokens back, one spent
    for attempt in range(3):  # re-run if the call took 500 ms or more (a stalled machine): one more token is back
        t0 = await store_now_ms(r)
        await set_bucket(r, U17_READ, 0, age_ms=5_000)
        d = await admit(agent, f"read-5000ms-{attempt}")
        if await store_now_ms(r) - t0 < 500:
            break
    assert d["allowed"] is True and d["remaining"] == 9 and d["httpStatus"] == 200
    assert "Retry-After" not in d["headers"]


async def test_weighted_export_retry_after_4(agent, r):
    await set_bucket(r, U17_READ, 3_000)
    d = await admit(agent, "weighted-01", cost=10)
    assert (d["allowed"], d["retryAfterMs"], d["deniedScope"]) == (False, 3_500, "user")
    assert d["headers"]["Retry-After"] == "4"
    assert d["headers"]["RateLimit"] == '"read-user-v3";r=3;t=4'


async def test_multi_rule_walkthrough(agent, r):
    # {1, 0, 0, 0, 638000}
    await set_bucket(r, U17_READ, 1_000)
    await set_bucket(r, ATLAS, 639_000)
    d = await admit(agent, "walk-000001")
    assert d["allowed"] is True and d["remaining"] == 0
    assert (await bucket_tokens(r, U17_READ), await bucket_tokens(r, ATLAS)) == (0, 638_000)
    # {0, 1, 500, 0, 639000}: the tenant bucket is untouched
    await set_bucket(r, ATLAS, 639_000)
    d = await admit(agent, "walk-000002")
    assert (d["allowed"], d["deniedScope"], d["retryAfterMs"]) == (False, "user", 500)
    assert await bucket_tokens(r, ATLAS) == 639_000
    # {0, 2, 420, ...}: tenant holds 3,000, the request costs 10,000; the user bucket untouched
    await set_bucket(r, U17_READ, 20_000)
    await set_bucket(r, ATLAS, 3_000)
    d = await admit(agent, "walk-000003", cost=10)
    assert (d["allowed"], d["deniedScope"], d["retryAfterMs"]) == (False, "tenant", 420)
    assert d["policyId"] == "tenant-atlas-minute"
    assert d["headers"]["Retry-After"] == "1"
    assert "RateLimit" not in d["headers"] and "RateLimit-Policy" not in d["headers"]  # tenant-wide: not exposed
    assert await bucket_tokens(r, U17_READ) == 20_000


async def test_cost_above_capacity_never_succeeds(agent, r):
    d = await admit(agent, "toobig-0001", cost=21)  # 21,000 millitokens > capacity 20,000
    assert (d["allowed"], d["retryAfterMs"], d["httpStatus"]) == (False, -1, 429)
    assert "Retry-After" not in d["headers"]
    metrics = (await agent.get("/metrics")).text
    assert 'leasehold_agent_policy_defects_total{rule="read-user-v3"} 1.0' in metrics


async def test_anonymous_fixed_window_generic_answer(agent):
    body = lambda i: admit_body(f"anon-{i:05d}", tenant=None, ptype="anonymous", pid="203.0.113.9",  # noqa: E731
                                route="login", api_key=None)
    results = []
    for i in range(21):
        resp = await agent.post("/v1/admit", json=body(i))
        results.append(resp.json())
    allowed = [d["allowed"] for d in results]
    # aligned 10 s windows: the 20 may straddle a boundary, then fewer are denied
    assert allowed.count(True) >= 20
    denied = [d for d in results if not d["allowed"]]
    for d in denied:
        assert d["httpStatus"] == 429 and "Retry-After" in d["headers"]
        assert set(d["headers"]) == {"Retry-After"}
        assert d["problem"] == {"type": "about:blank", "title": "Too Many Requests", "status": 429}
    for d in results:
        assert "RateLimit" not in d["headers"]


async def test_concurrency_fourth_export_denied_and_release(agent, r):
    exports = [await admit(agent, f"export-{i:03d}", route="export") for i in range(3)]
    assert all(d["allowed"] for d in exports)
    fourth = await admit(agent, "export-004", route="export")
    assert (fourth["allowed"], fourth["deniedScope"], fourth["reason"]) == (False, "concurrency",
                                                                            "CONCURRENCY_EXCEEDED")
    assert fourth["retryAfterMs"] == 5_000 and fourth["headers"]["Retry-After"] == "5"
    assert fourth["httpStatus"] == 429
    cc = tenant_key("atlas", "export") + ":cc"
    assert await r.zcard(cc) == 3
    rel = {"requestId": "export-001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
           "routeGroup": "export"}
    for freed in (1, 0):  # idempotent: the second release frees nothing and says so
        resp = await agent.post("/v1/release", json=rel)
        assert resp.status_code == 200 and resp.json() == {"requestId": "export-001", "released": freed, "gates": 1}
        assert await r.zcard(cc) == 2
    fifth = await admit(agent, "export-005", route="export")
    assert fifth["allowed"] is True
    assert await r.zcard(cc) == 3


async def test_idempotent_export_debited_once(agent, r):
    export = tenant_key("atlas", "export")
    await set_bucket(r, export, 1_000_000)
    first = await admit(agent, "r-e41-export", route="export")
    again = await admit(agent, "r-e41-export", route="export")
    assert first["allowed"] is True and again == first
    assert await bucket_tokens(r, export) == 990_000
    assert await r.zcard(export + ":cc") == 1
