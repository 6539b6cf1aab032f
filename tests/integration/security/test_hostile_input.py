"""Key-shaping attempts never reach Redis; principal ids of any content hash to safe keys; the
cases schemathesis found, kept as regular tests."""

from __future__ import annotations

import re

import pytest
import redis
from litestar.testing import AsyncTestClient

from kernel.bundle import Pool
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.allocator_app import in_process, settings_for, unique_prefix
from tests.support.policies import write_pools

SAFE_KEY = re.compile(r"^rl:v3:\{(t:[a-z0-9-]{1,32}|ip:[0-9a-f]{16}|g:[a-z0-9._-]+)\}:[A-Za-z0-9:._-]+$")


@pytest.mark.parametrize("tenant", ["at}las", "at:las", "{t:atlas}", "ätlas", "a" * 33, "ATLAS", "", "a b",
                                    "atlas\n", "at\u0000las"])
async def test_key_shaping_tenant_ids_never_reach_redis(redis_url, policy_file, tenant):
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        resp = await agent.post("/v1/admit", json=admit_body("shape-000001", tenant=tenant))
        assert resp.status_code in (400, 422) and resp.headers["content-type"].startswith("application/problem+json")
        batch = await agent.post("/v1/admit/batch", json={"requests": [admit_body("shape-000002"),
                                                                       admit_body("shape-000003", tenant=tenant)]})
        assert batch.status_code in (400, 422)
        assert r.dbsize() == 0  # nothing written, not even for the valid first item of the batch


@pytest.mark.parametrize("pid", ["U}{:*?[", "ü" * 200, "x" * 256, "{t:birch}", "rl:v3:*", "' OR 1=1 --",
                                 "../../etc/passwd"])
async def test_principal_ids_of_any_content_hash_to_safe_keys(redis_url, policy_file, pid):
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        body = admit_body("safe-000001", pid=pid, api_key=pid)
        d = (await agent.post("/v1/admit", json=body)).json()
        assert d["allowed"]
        keys = [k.decode() for k in r.keys("*")]
        assert keys and all(SAFE_KEY.match(k) for k in keys), keys
        assert not any(pid in k for k in keys if len(pid) > 2)


@pytest.mark.parametrize("pid", ["a\nb\r\n", "\u0000", " admin", "admin\t"])
async def test_principal_ids_that_are_no_identity_text_are_refused(redis_url, policy_file, pid):
    """A control character, or a space or tab at either end: no header carries the id as it is
    (a backend reads " admin" as admin), so no door asks about it (kernel.ids.ID_TEXT)."""
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        for body in (admit_body("text-000001", pid=pid), admit_body("text-000002", api_key=pid)):
            assert (await agent.post("/v1/admit", json=body)).status_code == 422
        assert r.dbsize() == 0


async def test_overlong_principal_and_body_are_refused(redis_url, policy_file):
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        resp = await agent.post("/v1/admit", json=admit_body("long-000001", pid="x" * 257))
        assert resp.status_code == 422
        resp = await agent.post("/v1/admit", json={**admit_body("long-000002"), "pad": "y" * 20_000})
        assert resp.status_code in (400, 413, 422)
        assert r.dbsize() == 0


# -- found by schemathesis -----------------------------------------------------------------------
async def test_errors_are_documented_as_problem_json(redis_url, policy_file):
    """Schemathesis ST105: Litestar documented its 400 as application/json while every error
    answer is application/problem+json."""
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        schema = (await agent.get("/schema/openapi.json")).json()
        admit = schema["paths"]["/v1/admit"]["post"]["responses"]
        for code in ("400", "401", "413", "422", "503"):
            assert list(admit[code]["content"]) == ["application/problem+json"]
        resp = await agent.post("/v1/admit", content=b"\x00", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/problem+json")


async def test_allocator_errors_are_documented_as_problem_json(etcd_cluster, tmp_path):
    bundle = write_pools(tmp_path / "b.json", [Pool(id="p1", window_ms=60_000, limit=10, chunk_max=5)])
    async with in_process(settings_for(etcd_cluster, bundle, unique_prefix())) as client:
        schema = (await client.get("/schema/openapi.json")).json()
        for path, method in (("/v1/leases", "post"), ("/v1/leases/{lease_id}", "get")):
            responses = schema["paths"][path][method]["responses"]
            assert all(list(responses[c]["content"]) == ["application/problem+json"] for c in ("400", "403", "422"))
        resp = await client.post("/v1/leases", content=b"\x00", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/problem+json")
