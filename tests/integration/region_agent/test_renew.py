"""Concurrency heartbeat (docs/api.md): an export that runs longer than its
rule's ``concurrencyTtlMs`` keeps its slot while the gateway renews it (``POST /v1/renew``,
idempotent, by requestId), so a 4th concurrent export is still denied; a slot that is released or
left to expire is not revived by a renewal; a release says how many slots it freed. Real Redis, the
app in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.redis_buckets import tenant_key

TTL_MS = 3_000  # heartbeats every TTL/6: a busy machine's stall of up to ~2.5 s does not end a slot


@pytest.fixture
async def export_agent(redis_url: str, tmp_path: Path):
    base = northstar()
    rules = [r if r.id != "export-tenant" else _short_ttl(r) for r in base.rules]
    policy = tmp_path / "bundle.json"
    write_bundle(policy, base, rules=rules)
    app = create_app(make_settings(redis_url, policy), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


def _short_ttl(rule):
    import msgspec

    return msgspec.structs.replace(rule, concurrency_ttl_ms=TTL_MS)


def _release_body(rid: str) -> dict:
    return {"requestId": rid, "tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
            "routeGroup": "export"}


async def test_heartbeats_keep_long_exports_counted(export_agent):
    client = export_agent
    ids = [f"exp-long-{i:04d}" for i in range(3)]
    for rid in ids:
        assert (await admit_json(client, rid, route="export"))["allowed"]
    deadline = asyncio.get_running_loop().time() + 2 * TTL_MS / 1000  # outlives the TTL twice
    while asyncio.get_running_loop().time() < deadline:  # heartbeat at a sixth of the TTL
        for rid in ids:
            resp = await client.post("/v1/renew", json=_release_body(rid))
            assert resp.status_code == 200, resp.text
            assert resp.json()["renewed"] == 1, resp.json()
        await asyncio.sleep(TTL_MS / 6000)
    fourth = await admit_json(client, "exp-long-0004", route="export")
    assert not fourth["allowed"] and fourth["deniedScope"] == "concurrency", fourth
    # idempotent: renewing twice is fine; a released slot is not revived
    assert (await client.post("/v1/renew", json=_release_body(ids[0]))).json()["renewed"] == 1
    assert (await client.post("/v1/release", json=_release_body(ids[0]))).json() == {
        "requestId": ids[0], "released": 1, "gates": 1}
    gone = await client.post("/v1/renew", json=_release_body(ids[0]))
    assert gone.status_code == 200 and gone.json()["renewed"] == 0, gone.json()
    assert (await admit_json(client, "exp-long-0005", route="export"))["allowed"]
    # bad input is a 4xx problem, never a 500
    bad = await client.post("/v1/renew", json={"requestId": "x"})
    assert bad.status_code in (400, 422) and bad.headers["content-type"].startswith("application/problem+json")


async def test_without_heartbeats_the_slot_expires(export_agent):
    client = export_agent
    for i in range(3):
        assert (await admit_json(client, f"exp-short-{i:04d}", route="export"))["allowed"]
    await asyncio.sleep(TTL_MS / 1000 + 0.3)
    gone = await client.post("/v1/renew", json=_release_body("exp-short-0000"))
    assert gone.status_code == 200 and gone.json()["renewed"] == 0  # an expired slot is not revived
    assert (await admit_json(client, "exp-short-0003", route="export"))["allowed"]


async def test_a_release_counts_only_the_slots_it_freed(export_agent, redis_url: str):
    """``/v1/release`` answered ``released: 1`` (the number of gates) for a request id that was never
    admitted, or was released already, or whose slot had expired: an operator or a gateway's log
    was told a slot was freed when none was. It now says how many live slots it freed."""
    client = export_agent

    async def release(rid: str, route: str = "export") -> dict:
        resp = await client.post("/v1/release", json={**_release_body(rid), "routeGroup": route})
        assert resp.status_code == 200, resp.text
        return resp.json()

    assert await release("exp-never-0001") == {"requestId": "exp-never-0001", "released": 0, "gates": 1}
    assert (await admit_json(client, "exp-rel-0001", route="export"))["allowed"]
    assert await release("exp-rel-0001") == {"requestId": "exp-rel-0001", "released": 1, "gates": 1}
    assert await release("exp-rel-0001") == {"requestId": "exp-rel-0001", "released": 0, "gates": 1}
    assert await release("exp-rel-0001", route="read") == {"requestId": "exp-rel-0001", "released": 0, "gates": 0}
    assert (await admit_json(client, "exp-old-0001", route="export"))["allowed"]
    await asyncio.sleep(TTL_MS / 2000)
    assert (await admit_json(client, "exp-keep-0001", route="export"))["allowed"]  # keeps the gate's key alive
    await asyncio.sleep(TTL_MS / 2000 + 0.3)
    r = Redis.from_url(redis_url)
    try:  # expired, but still a member: nothing has written since (a write trims it)
        assert await r.zscore(tenant_key("atlas", "export") + ":cc", "exp-old-0001") is not None
    finally:
        await r.aclose()
    assert await release("exp-old-0001") == {"requestId": "exp-old-0001", "released": 0, "gates": 1}
    assert await release("exp-keep-0001") == {"requestId": "exp-keep-0001", "released": 1, "gates": 1}
