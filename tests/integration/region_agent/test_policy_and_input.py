"""Policy reload through the app, shadow rules, global-pool chunks, malformed input."""

from __future__ import annotations

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from kernel.bundle import Pool, Rule, make_rule, validate_bundle
from kernel.errors import PolicyError
from region_agent.service.app import create_app
from region_agent.store.scripts import Scripts
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.redis_buckets import set_bucket, user_key


@pytest.fixture
async def r(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_reload_accepts_only_higher_versions(redis_url, policy_file):
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    holder = app.state.agent.holder
    async with AsyncTestClient(app=app) as agent:
        assert (await agent.get("/v1/policy")).json()["bundleVersion"] == 42
        base = northstar()
        write_bundle(policy_file, base, bundle_version=41)
        assert holder.reload().outcome == "stale"
        write_bundle(policy_file, base, bundle_version=42, published_at="2030-01-01T00:00:00Z")  # another 42
        assert holder.reload().outcome == "stale"
        write_bundle(policy_file, base)  # the bundle in force again: no refusal, not counted
        assert holder.reload().outcome == "unchanged"
        policy_file.write_text(policy_file.read_text().replace('"capacityMillis": 20000', '"capacityMillis": 30000'))
        assert holder.reload().outcome == "invalid"  # checksum no longer matches
        d = (await agent.post("/v1/admit", json=admit_body("reload-0001"))).json()
        assert d["policyVersion"] == 42 and d["limit"] == 20
        tighter = [msgspec.structs.replace(x, capacity_millis=10_000) if x.id == "read-user-v3" else x
                   for x in base.rules]
        write_bundle(policy_file, base, bundle_version=43, rules=tighter)
        assert holder.reload().outcome == "accepted"
        info = (await agent.get("/v1/policy")).json()
        assert info["bundleVersion"] == 43 and "read-user-v3" in info["ruleIds"]
        d = (await agent.post("/v1/admit", json=admit_body("reload-0002"))).json()
        # stored tokens are clamped to the lowered capacity on the next call
        assert d["policyVersion"] == 43 and d["limit"] == 10 and d["remaining"] == 9
        metrics = (await agent.get("/metrics")).text
        assert 'leasehold_agent_policy_reloads_total{outcome="stale"} 2.0' in metrics
        assert 'leasehold_agent_policy_reloads_total{outcome="invalid"} 1.0' in metrics
        assert 'leasehold_agent_policy_reloads_total{outcome="accepted"} 1.0' in metrics


async def test_shadow_rule_never_affects_the_decision(redis_url, policy_file):
    base = northstar()
    shadow = make_rule(id="shadow-route-read", scope="route", route_group="read", algorithm="fixed_window", limit=1,
                  window_ms=60_000, fail_mode="open", shadow=True)
    write_bundle(policy_file, base, rules=[*base.rules, shadow])
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        ds = [(await agent.post("/v1/admit", json=admit_body(f"shadow-{i:04d}"))).json() for i in range(3)]
        assert all(d["allowed"] and d["policyId"] == "read-user-v3" for d in ds)
        metrics = (await agent.get("/metrics")).text
        assert 'leasehold_agent_shadow_decisions_total{outcome="allowed",rule="shadow-route-read"} 1.0' in metrics
        assert 'leasehold_agent_shadow_decisions_total{outcome="denied",rule="shadow-route-read"} 2.0' in metrics


async def test_global_pool_spent_from_a_local_chunk(redis_url, policy_file, r):
    base = northstar()
    pool = Pool(id="p-global", window_ms=60_000, limit=40_000, chunk_min=1, chunk_max=10, chunk_validity_ms=60_000)
    rule = make_rule(id="global-read", scope="global", route_group="read", algorithm="pool", pool="p-global",
                fail_mode="closed")
    write_bundle(policy_file, base, rules=[*base.rules, rule], pools=[pool])
    gkey = "rl:v3:{g:p-global}:pool:p-global"
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        # an empty balance simply denies (the lease manager fills it in a later task)
        d = (await agent.post("/v1/admit", json=admit_body("pool-empty-1"))).json()
        assert (d["allowed"], d["deniedScope"], d["httpStatus"]) == (False, "global", 429)
        assert "RateLimit" not in d["headers"]
    sec, usec = await r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    await Scripts().pool_deposit(r, gkey, "lease-1", granted=14, valid_from_ms=now - 1000, expires_at_ms=now + 60_000,
                                 max_entries=16, slack_ms=1000)
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        ds = [(await agent.post("/v1/admit", json=admit_body(f"pool-{i:04d}", pid=f"U-{i}"))).json()
              for i in range(15)]
        # chunks follow this agent's demand (what it was asked over the last quarter of a chunk's
        # validity, at most chunkMax): 1, 2 and 4 tokens for the first 7 requests, then a partial
        # chunk of the 7 left (8 were asked), then the pool is dry
        assert [d["allowed"] for d in ds] == [True] * 14 + [False]
        assert ds[-1]["deniedScope"] == "global"
        entry = (await r.hget(gkey, "lease-1")).decode().split(",")
        assert entry[:2] == ["14", "14"]
        metrics = (await agent.get("/metrics")).text
        assert 'leasehold_agent_pool_renewals_total{outcome="granted",pool="p-global"} 3.0' in metrics
        assert 'leasehold_agent_pool_renewals_total{outcome="partial",pool="p-global"} 1.0' in metrics


async def test_tenant_denial_gives_the_global_reservation_back(redis_url, policy_file, r):
    base = northstar()
    pool = Pool(id="p-global", window_ms=60_000, limit=40_000, chunk_min=1, chunk_max=10, chunk_validity_ms=60_000)
    rule = make_rule(id="global-read", scope="global", route_group="read", algorithm="pool", pool="p-global",
                fail_mode="closed")
    write_bundle(policy_file, base, rules=[*base.rules, rule], pools=[pool])
    gkey = "rl:v3:{g:p-global}:pool:p-global"
    sec, usec = await r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    await Scripts().pool_deposit(r, gkey, "lease-1", granted=10, valid_from_ms=now - 1000, expires_at_ms=now + 60_000,
                                 max_entries=16, slack_ms=1000)
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        await set_bucket(r, user_key("atlas", "U-17", "read"), 0)  # U-17's own bucket is empty
        denied = [(await agent.post("/v1/admit", json=admit_body(f"pool-u17-{i}"))).json() for i in range(3)]
        assert all(d["allowed"] is False and d["deniedScope"] == "user" for d in denied)
        # the chunk of 10 was bought once; the three reservations went back to it in-process
        ds = [(await agent.post("/v1/admit", json=admit_body(f"pool-r-{i:03d}", pid=f"U-{i}"))).json()
              for i in range(11)]
        assert [d["allowed"] for d in ds] == [True] * 10 + [False]
        assert (await r.hget(gkey, "lease-1")).decode().split(",")[:2] == ["10", "10"]


@pytest.mark.parametrize("body, status", [
    ({"requestId": "short", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read"},
     (400, 422)),
    ({"requestId": "req-000001", "tenantId": "at}las", "principal": {"type": "user", "id": "U-17"},
      "routeGroup": "read"}, (400, 422)),
    ({"requestId": "req-000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
      "routeGroup": "read", "extra": 1}, (400, 422)),
    ({"requestId": "req-000001", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read"}, (422,)),
    ({"requestId": "req-000001", "principal": {"type": "anonymous", "id": "not-an-ip"}, "routeGroup": "login"},
     (422,)),
    ({"requestId": "req-000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
      "routeGroup": "read", "costHint": 0}, (400, 422)),
    ({"requestId": "req-000001", "tenantId": "atlas", "principal": {"type": "root", "id": "U-17"},
      "routeGroup": "read"}, (400, 422)),
])
async def test_malformed_requests_get_problem_json(agent, r, body, status):
    resp = await agent.post("/v1/admit", json=body)
    assert resp.status_code in status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    problem = resp.json()
    assert problem["status"] == resp.status_code and problem["type"].startswith("https://leasehold.dev/problems/")
    assert await r.dbsize() == 0  # nothing reached a key


async def test_not_json_and_too_large(agent):
    resp = await agent.post("/v1/admit", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/problem+json")
    big = admit_body("req-big-001")
    big["method"] = "G" * 20_000
    resp = await agent.post("/v1/admit", json=big)
    assert resp.status_code == 413 and resp.headers["content-type"].startswith("application/problem+json")


async def test_openapi_and_health(agent):
    schema = (await agent.get("/schema/openapi.json")).json()
    assert "/v1/admit" in schema["paths"] and "/v1/admit/batch" in schema["paths"]
    # the handlers' injected services (agent state, engine) are not request parameters
    for path in ("/v1/admit", "/v1/admit/batch", "/v1/release", "/v1/renew"):
        assert "parameters" not in schema["paths"][path]["post"], schema["paths"][path]["post"]
    assert "parameters" not in schema["paths"]["/v1/policy"]["get"]
    # deniedScope is an enum in the code and the same inline string enum in the document (kernel.openapi_enums)
    assert schema["components"]["schemas"]["Decision"]["properties"]["deniedScope"] == {
        "enum": ["user", "key", "route", "tenant", "global", "concurrency", "ip", None], "type": ["null", "string"]}
    assert "DeniedScope" not in schema["components"]["schemas"]
    assert (await agent.get("/healthz")).json() == {"status": "ok"}
    ready = (await agent.get("/readyz")).json()
    assert ready["status"] == "ready" and ready["policyVersion"] == 42


def test_a_rule_set_needing_more_script_slots_than_the_script_takes_is_refused(policy_file):
    """Eight rules plus a concurrency gate is nine script slots (the script takes eight): the
    bundle is refused at validation, so no request can ever reach the script with it."""
    def rule(rid: str, scope: str, route: str | None, **kw) -> Rule:
        return make_rule(id=rid, scope=scope, route_group=route, algorithm="fixed_window", limit=100, window_ms=60_000,
                    fail_mode=kw.pop("fail_mode", "open"), **kw)

    rules = [rule(f"{s}-{g or 'all'}", s, g) for s in ("user", "key", "route", "tenant") for g in ("read", None)]
    rules[-1] = rule("tenant-all", "tenant", None, concurrency_max=5, fail_mode="closed")
    bundle = write_bundle(policy_file, northstar(), rules=rules, bundle_version=50)
    with pytest.raises(PolicyError) as e:
        validate_bundle(bundle)
    assert any("9 script slots" in p for p in e.value.errors)


async def test_unknown_path_and_method_are_problems(agent):
    resp = await agent.get("/v1/nope")
    assert resp.status_code == 404 and resp.json()["type"].endswith("/not-found")
    resp = await agent.get("/v1/admit")
    assert resp.status_code == 405 and resp.headers["content-type"].startswith("application/problem+json")
