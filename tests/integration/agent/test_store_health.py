"""Store health per shard from real Redis servers (region_agent/store_health.py): a primary with a
replica (replicas, replica lag, memory, keys, script time) and a 3-master Redis Cluster (one series
per primary; decision latency labelled with the shard that decided)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from litestar.testing import AsyncTestClient

from leasehold.procs import RedisServer
from region_agent.app import create_app

from .conftest import PEPPER, admit_json, make_settings


async def wait_for(pred, within_s: float = 15.0):
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        got = await pred()
        if got:
            return got
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


def value(text: str, name: str, shard: str) -> float | None:
    m = re.search(rf'^{name}{{shard="{re.escape(shard)}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


async def test_primary_with_a_replica(tmp_path: Path, policy_file: Path):
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica").start()
    try:
        replica.cli("REPLICAOF", "127.0.0.1", str(primary.port))
        app = create_app(make_settings(primary.url, policy_file, store_health_ms=100), pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            for i in range(5):
                assert (await admit_json(agent, f"health-{i:04d}"))["allowed"]

            async def polled() -> str | None:
                text = (await agent.get("/metrics")).text
                ok = (value(text, "leasehold_agent_redis_replicas", "default") == 1
                      and (value(text, "leasehold_agent_redis_script_calls_total", "default") or 0) >= 5)
                return text if ok else None
            text = await wait_for(polled)
            assert value(text, "leasehold_agent_redis_memory_used_bytes", "default") > 0
            assert value(text, "leasehold_agent_redis_memory_max_bytes", "default") == 0  # no limit configured
            assert value(text, "leasehold_agent_redis_keys", "default") >= 2  # user + tenant buckets
            assert value(text, "leasehold_agent_redis_replica_lag_seconds", "default") >= 0
            assert value(text, "leasehold_agent_redis_replica_lag_bytes", "default") >= 0
            assert value(text, "leasehold_agent_redis_connected_clients", "default") >= 1  # us (replicas not counted)
            assert value(text, "leasehold_agent_redis_script_seconds_total", "default") > 0
            assert value(text, "leasehold_agent_redis_info_age_seconds", "default") < 5
            # the primary goes away: the last snapshot stays and its age grows (the poll is bounded)
            primary.stop()
            await asyncio.sleep(1.0)
            text = (await agent.get("/metrics")).text
            assert value(text, "leasehold_agent_redis_replicas", "default") == 1
            assert value(text, "leasehold_agent_redis_info_age_seconds", "default") >= 0.5
    finally:
        replica.stop()
        primary.stop()


async def test_one_series_per_cluster_primary_and_latency_by_shard(redis_cluster, redis_cluster_url, policy_file):
    url = redis_cluster_url.replace("redis://", "redis+cluster://")
    app = create_app(make_settings(url, policy_file, store_health_ms=100), pepper=PEPPER)
    primaries = {f"127.0.0.1:{n.port}" for n in redis_cluster.nodes}
    async with AsyncTestClient(app=app) as agent:
        for tenant in ("atlas", "birch"):
            d = await admit_json(agent, f"cl-health-{tenant}", tenant=tenant)
            assert d["allowed"]

        async def shards() -> set[str] | None:
            text = (await agent.get("/metrics")).text
            got = set(re.findall(r'^leasehold_agent_redis_keys\{shard="([^"]+)"\}', text, re.M))
            return got if got == primaries else None
        await wait_for(shards)
        text = (await agent.get("/metrics")).text
        decided = set(re.findall(r'^leasehold_agent_decision_seconds_count\{outcome="allowed",shard="([^"]+)"\}',
                                 text, re.M))
        assert decided and decided <= primaries  # the primary that owns each tenant's slot
