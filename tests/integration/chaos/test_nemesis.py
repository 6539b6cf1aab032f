"""Nemeses against real processes and a real proxied link, recorded in a history file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chaos.history import Fault, HistoryWriter, read_history
from chaos.nemesis import (
    Combined,
    Kill,
    Latency,
    Partition,
    Pause,
    RedisRestart,
    Refuse,
    Schedule,
    Step,
    port_ready,
)
from chaos.proxy import FaultProxy
from leasehold.local.procs import LOOPBACK, RedisServer
from tests.support.waiting import await_until

pytestmark = pytest.mark.integration


def client(port: int, timeout: float = 0.5) -> aredis.Redis:
    return aredis.Redis(host=LOOPBACK, port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                        retry=Retry(NoBackoff(), 0), retry_on_error=[])


@pytest.fixture
def own_redis(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


async def test_scheduled_partition_and_latency_are_applied_healed_and_recorded(own_redis: RedisServer,
                                                                               tmp_path: Path):
    hist = tmp_path / "h.jsonl"
    async with FaultProxy((LOOPBACK, own_redis.port)) as proxy:
        with HistoryWriter(hist) as w:
            part = Partition(proxy, "both", target="agent-eu->redis-eu", recorder=w)
            lat = Latency(proxy, 40, 5, "down", target="agent-eu->redis-eu", recorder=w)
            # the partition lasts long enough that a stall of the test does not outlast it before the
            # ping below (the schedule runs on the loop's clock, as the test does)
            sched = Schedule(3.5, [Step(0.0, part, 2.5), Step(2.7, lat, 0.4)])
            task = asyncio.create_task(sched.run())
            assert await await_until(lambda: part.active, within_s=2.0), "the partition never started"
            assert proxy.state()["faults"]["up"]["blackhole"]
            with pytest.raises(RedisTimeoutError):
                await client(proxy.port, 0.2).ping()
            records = await task
        assert not part.active and not lat.active
        assert proxy.state()["faults"]["down"] == {"latency_ms": 0.0, "jitter_ms": 0.0, "blackhole": False,
                                                   "bandwidth_bps": 0}
        assert await client(proxy.port).ping()
    saved = [r for r in read_history(hist) if isinstance(r, Fault)]
    assert [r.nemesis for r in saved] == ["partition", "latency"] and saved == records
    assert all(r.stop_ms is not None and r.stop_ms >= r.start_ms for r in saved)


async def test_schedule_cancelled_midway_still_heals(own_redis: RedisServer):
    async with FaultProxy((LOOPBACK, own_redis.port)) as proxy:
        part = Partition(proxy, "up")
        task = asyncio.create_task(Schedule(30, [Step(0, part, 30)]).run())
        assert await await_until(lambda: part.active), "the partition never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not part.active and not proxy.state()["faults"]["up"]["blackhole"]


async def test_pause_freezes_and_resumes_a_real_redis(own_redis: RedisServer):
    r = client(own_redis.port)
    await r.set("k", "v")
    async with Pause(own_redis.proc).active_for():
        with pytest.raises(RedisTimeoutError):
            await client(own_redis.port, 0.3).get("k")
    assert await client(own_redis.port).get("k") == b"v"


async def test_kill_with_restart_and_redis_restart_lose_state_and_script_cache(own_redis: RedisServer):
    r = client(own_redis.port)
    await r.set("k", "v")
    sha = await r.script_load("return 1")
    restart = RedisRestart(own_redis)
    await restart.start()
    with pytest.raises((RedisConnectionError, RedisTimeoutError)):
        await client(own_redis.port).ping()
    await restart.stop()
    fresh = client(own_redis.port)
    assert await fresh.get("k") is None and await fresh.script_exists(sha) == [False]
    await fresh.set("k2", "v2")
    assert own_redis.proc is not None
    kill = Kill(own_redis.proc, ready=port_ready(own_redis.port))
    old_pid = own_redis.proc.pid
    async with Combined(kill).active_for():
        assert not own_redis.proc.alive()
    assert own_redis.proc.alive() and own_redis.proc.pid != old_pid
    assert await client(own_redis.port).get("k2") is None
    assert [rec.nemesis for rec in restart.records + kill.records] == ["redis-restart", "kill"]


async def test_refuse_nemesis_makes_the_upstream_look_down_then_heals(own_redis: RedisServer):
    async with FaultProxy((LOOPBACK, own_redis.port)) as proxy:
        r = client(proxy.port)
        assert await r.ping()
        refuse = Refuse(proxy, target="agent-us->redis-us")
        async with refuse.active_for():
            with pytest.raises((RedisConnectionError, RedisTimeoutError)):
                await r.ping()  # the open connection was reset
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(LOOPBACK, proxy.port)
        assert await client(proxy.port).ping()
        assert refuse.records[0].detail == "reset open connections"
        await r.aclose()
