"""A tenant split across k slots (kernel/split.py) through the agent, on a real 3-primary Redis
Cluster: its sub-buckets live in different slots on different primaries, a flood from one
principal takes its sub-bucket's share and no more, and the tenant's total stays within its
limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import RedisCluster

from kernel.split import TenantSplit, share
from region_agent.decision.keys import KeyBuilder
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.policies import northstar, write_bundle

K = 4
CAPACITY = 40_000  # millitokens: 40 requests at cost 1, 10 per sub-bucket; refill negligible (4 per hour)


def split_bundle():
    b = northstar()
    rules = []
    for r in b.rules:
        if r.id == "export-tenant":  # (its concurrencyMax 3 cannot be split 4 ways: validation refuses it)
            continue
        if r.id == "tenant-atlas-minute":
            r = msgspec.structs.replace(r, capacity_millis=CAPACITY, refill_millis=4, period_ms=3_600_000)
        rules.append(r)
    return msgspec.structs.replace(b, rules=rules, tenant_splits=[TenantSplit("atlas", K)])


@pytest.fixture
async def split_agent(redis_cluster_url: str, tmp_path: Path) -> AsyncIterator[AsyncTestClient]:
    policy = tmp_path / "split.json"
    write_bundle(policy, split_bundle(), tenant_splits=[TenantSplit("atlas", K)])
    url = redis_cluster_url.replace("redis://", "redis+cluster://")
    app = create_app(make_settings(url, policy), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


@pytest.fixture
async def rc(redis_cluster_url):
    client = RedisCluster.from_url(redis_cluster_url)
    yield client
    await client.aclose()


def tenant_sub_key(i: int) -> str:
    return f"rl:v3:{{t:atlas:{i}}}:tenant:atlas:all"


def principals_per_sub_bucket(n_each: int) -> dict[int, list[str]]:
    kb = KeyBuilder(PEPPER)
    out: dict[int, list[str]] = {i: [] for i in range(K)}
    for j in range(1000):
        pid = f"U-{j}"
        sub = kb.sub_bucket("atlas", "user", pid, K)
        if len(out[sub]) < n_each:
            out[sub].append(pid)
        if all(len(v) == n_each for v in out.values()):
            return out
    raise AssertionError("1000 principals did not cover every sub-bucket")


async def test_a_flood_from_one_principal_takes_its_share_and_no_more(split_agent, rc):
    sub = KeyBuilder(PEPPER).sub_bucket("atlas", "user", "U-17", K)
    mine = share(CAPACITY, K, sub) // 1000
    got = [await admit_json(split_agent, f"split-flood-{i:03d}", pid="U-17") for i in range(mine + 8)]
    admitted = [d for d in got if d["allowed"]]
    assert len(admitted) == mine == 10
    denied = got[mine:]
    assert {(d["deniedScope"], d["policyId"], d["limit"]) for d in denied} == {("tenant", "tenant-atlas-minute", 10)}
    # only its own sub-bucket was spent: the other three are untouched (no key yet)
    assert await rc.exists(tenant_sub_key(sub)) == 1
    assert [await rc.exists(tenant_sub_key(i)) for i in range(K) if i != sub] == [0] * (K - 1)
    assert await rc.exists("rl:v3:{t:atlas}:tenant:atlas:all") == 0  # the unsplit tag is not used


async def test_the_tenants_total_stays_within_its_limit_across_sub_buckets(split_agent, rc):
    by_sub = principals_per_sub_bucket(3)
    admitted = {i: 0 for i in range(K)}
    n = 0
    for sub, pids in by_sub.items():
        for pid in pids:  # 3 principals x 6 attempts = 18 attempts against a share of 10
            for _ in range(6):
                d = await admit_json(split_agent, f"split-total-{n:04d}", pid=pid)
                n += 1
                admitted[sub] += d["allowed"]
    assert admitted == {i: share(CAPACITY, K, i) // 1000 for i in range(K)}
    assert sum(admitted.values()) == CAPACITY // 1000  # the tenant total reaches its limit and no more


async def test_the_sub_buckets_land_in_different_slots_on_different_primaries(split_agent, rc):
    by_sub = principals_per_sub_bucket(1)
    for sub, (pid,) in by_sub.items():
        assert (await admit_json(split_agent, f"split-place-{sub}", pid=pid))["allowed"] is True
    keys = [tenant_sub_key(i) for i in range(K)]
    assert all([await rc.exists(k) for k in keys])
    slots = [await rc.cluster_keyslot(k) for k in keys]
    assert len(set(slots)) == K
    owners = {rc.get_node_from_key(k).name for k in keys}
    assert len(owners) == 3  # {t:atlas:0..3} spread over all three primaries
