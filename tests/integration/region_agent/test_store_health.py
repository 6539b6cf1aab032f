"""Store health per shard from real Redis servers (region_agent/service/store_health.py): a primary with a
replica (replicas, replica lag, memory, keys, script time) and a 3-master Redis Cluster (one series
per primary; decision latency labelled with the shard that decided)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer
from region_agent.service.app import create_app
from region_agent.service.store_health import EvictingStore
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.waiting import await_until


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
            text = await await_until(polled, within_s=15, interval=0.1)
            assert text
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
        assert await await_until(shards, within_s=15, interval=0.1)
        text = (await agent.get("/metrics")).text
        decided = set(re.findall(r'^leasehold_agent_decision_seconds_count\{outcome="allowed",shard="([^"]+)"\}',
                                 text, re.M))
        assert decided and decided <= primaries  # the primary that owns each tenant's slot


# --------------------------------------------------------------------------------------------
# maxmemory-policy: an evicted bucket is a full bucket (eviction silently resets enforcement)
async def test_an_evicting_store_is_refused_at_start(tmp_path: Path, policy_file: Path):
    redis = RedisServer(tmp_path / "lru", extra_args=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        app = create_app(make_settings(redis.url, policy_file), pepper=PEPPER)
        with pytest.raises(BaseException) as info:  # the lifespan's error, in the test client's task group
            async with AsyncTestClient(app=app):
                pass
        errors = [info.value]
        while errors and not isinstance(errors[0], EvictingStore):
            e = errors.pop(0)
            errors.extend(getattr(e, "exceptions", ()))
        assert errors and "maxmemory-policy allkeys-lru" in str(errors[0])
    finally:
        redis.stop()


def test_the_agent_process_refuses_to_start_with_a_clear_line(tmp_path: Path, policy_file: Path):
    import os
    import subprocess
    import sys

    from leasehold.local.services import agent_command
    from tests.support.policies import ROOT

    redis = RedisServer(tmp_path / "lru", extra_args=("--maxmemory-policy", "volatile-lru")).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
        env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
        cmd = agent_command(redis_url=redis.url, policy=policy_file, region="eu", host="127.0.0.1", port=0,
                            auth_disabled=True, policy_poll_ms=0, python=sys.executable)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "region_agent: refusing to start: the regional Redis may evict keys (default: maxmemory-policy " \
            "volatile-lru)" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr  # one line, as the agent's other refusals
    finally:
        redis.stop()


async def test_started_degraded_on_request_and_checked_again_by_every_poll(tmp_path: Path, policy_file: Path,
                                                                           caplog):
    redis = RedisServer(tmp_path / "lru", extra_args=("--maxmemory-policy", "allkeys-lru")).start()
    try:
        settings = make_settings(redis.url, policy_file, allow_evicting_store=True, store_health_ms=100)
        with caplog.at_level("ERROR", logger="region_agent.service.store_health"):
            async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
                assert "DEGRADED" in caplog.text and "allkeys-lru" in caplog.text
                assert value((await agent.get("/metrics")).text, "leasehold_agent_redis_evicting", "default") == 1
                assert (await agent.get("/readyz")).status_code == 200  # allowed: degraded, still serving
                assert (await admit_json(agent, "lru-000001"))["allowed"]
        # a store that starts clean and is switched to evicting while the agent runs
        redis.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        caplog.clear()
        settings = make_settings(redis.url, policy_file, store_health_ms=100)
        with caplog.at_level("ERROR", logger="region_agent.service.store_health"):
            async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
                assert (await agent.get("/readyz")).status_code == 200
                assert value((await agent.get("/metrics")).text, "leasehold_agent_redis_evicting", "default") == 0
                redis.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-random")

                async def flagged() -> bool:
                    text = (await agent.get("/metrics")).text
                    return value(text, "leasehold_agent_redis_evicting", "default") == 1
                assert await await_until(flagged, within_s=15, interval=0.1)
                ready = await agent.get("/readyz")
                assert ready.status_code == 503 and "allkeys-random" in ready.text
                assert "now has maxmemory-policy allkeys-random" in caplog.text
                redis.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")

                async def cleared() -> bool:
                    text = (await agent.get("/metrics")).text
                    return value(text, "leasehold_agent_redis_evicting", "default") == 0
                assert await await_until(cleared, within_s=15, interval=0.1)
                assert (await agent.get("/readyz")).status_code == 200
    finally:
        redis.stop()
