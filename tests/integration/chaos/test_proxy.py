"""The fault proxy in front of a real redis-server: each fault does what it says, healing restores."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chaos.proxy import FaultProxy, ProxyProcess
from kernel.errors import BadRequest
from leasehold.local.procs import LOOPBACK, RedisServer

pytestmark = pytest.mark.integration


def client(port: int, timeout: float = 0.5) -> aredis.Redis:
    return aredis.Redis(host=LOOPBACK, port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                        retry=Retry(NoBackoff(), 0), retry_on_error=[])


@pytest.fixture
async def proxy(redis_url: str, redis_server: RedisServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy((LOOPBACK, redis_server.port), seed=1) as p:
        yield p


async def test_passthrough_and_added_latency_is_visible(proxy: FaultProxy):
    r = client(proxy.port, timeout=5)
    try:
        assert await r.set("k", "v") and await r.get("k") == b"v"
        await proxy.latency(150, jitter_ms=20, direction="up")
        t0 = time.monotonic()
        assert await r.ping()
        assert time.monotonic() - t0 >= 0.13  # the request was held at least latency - jitter
        assert proxy.state()["faults"]["up"]["latency_ms"] == 150
        await proxy.heal()
        assert await r.get("k") == b"v"
    finally:
        await r.aclose()


async def test_bandwidth_cap_holds_a_large_reply_back(proxy: FaultProxy):
    r = client(proxy.port, timeout=10)
    try:
        await r.set("big", b"x" * 200_000)
        await proxy.set_faults("down", bandwidth_bps=400_000)
        t0 = time.monotonic()
        assert len(await r.get("big")) == 200_000
        assert time.monotonic() - t0 >= 0.45  # 200 kB paced at 400 kB/s cannot all arrive within 0.5 s
        assert proxy.state()["faults"]["down"]["bandwidth_bps"] == 400_000
    finally:
        await r.aclose()


async def test_blackhole_times_out_and_healing_restores(proxy: FaultProxy):
    r = client(proxy.port)
    try:
        assert await r.ping()
        await proxy.blackhole("both")
        fresh = client(proxy.port)
        with pytest.raises(RedisTimeoutError):
            await fresh.ping()  # a new connection is accepted but nothing comes back
        await fresh.aclose()
        await proxy.heal()
        healed = client(proxy.port)
        assert await healed.ping()
        await healed.aclose()
    finally:
        await r.aclose()


async def test_one_way_blackhole_delivers_the_request_but_not_the_reply(proxy: FaultProxy,
                                                                         redis_server: RedisServer):
    r = client(proxy.port)
    direct = aredis.Redis(host=LOOPBACK, port=redis_server.port)
    try:
        assert await r.ping()
        await proxy.blackhole("down")
        with pytest.raises(RedisTimeoutError):
            await r.set("one-way", "landed")
        assert await direct.get("one-way") == b"landed"  # the write reached Redis
        await proxy.blackhole("down", on=False)
        again = client(proxy.port)
        assert await again.get("one-way") == b"landed"
        await again.aclose()
    finally:
        await r.aclose()
        await direct.aclose()


async def test_reset_drops_open_connections(proxy: FaultProxy):
    reader, writer = await asyncio.open_connection(LOOPBACK, proxy.port)
    writer.write(b"PING\r\n")
    assert await asyncio.wait_for(reader.readline(), 5) == b"+PONG\r\n"
    assert await proxy.reset_connections() == 1
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(1), 5)
    writer.close()
    r = client(proxy.port)
    assert await r.ping()  # new connections work
    await r.aclose()


async def test_refuse_rejects_new_connections_only(proxy: FaultProxy):
    r = client(proxy.port)
    try:
        assert await r.ping()
        await proxy.refuse(True)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(LOOPBACK, proxy.port)
        assert await r.ping()  # the open connection is untouched
        await proxy.heal()
        fresh = client(proxy.port)
        assert await fresh.ping()
        await fresh.aclose()
    finally:
        await r.aclose()


async def test_bad_fault_parameters_are_rejected(proxy: FaultProxy):
    with pytest.raises(BadRequest, match="direction"):
        await proxy.set_faults("sideways", blackhole=True)
    with pytest.raises(BadRequest, match="latency_ms"):
        await proxy.set_faults("up", latency_ms=-1)
    with pytest.raises(BadRequest, match="loopback"):
        FaultProxy((LOOPBACK, 1), ("0.0.0.0", 0))


async def test_proxy_process_is_controlled_over_http(redis_url: str, redis_server: RedisServer, tmp_path: Path):
    proxy = ProxyProcess((LOOPBACK, redis_server.port), tmp_path, seed=3).start()
    port, ctl = proxy.port, proxy.control
    try:
        r = client(port)
        assert await r.ping()
        await ctl.blackhole("both")
        assert (await ctl.state())["faults"]["down"]["blackhole"] is True
        with pytest.raises(RedisTimeoutError):
            await client(port).ping()
        await ctl.heal()
        assert await client(port).ping()
        assert await ctl.reset_connections() >= 1
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            await r.ping()
        await r.aclose()
        with pytest.raises(BadRequest, match="400"):
            await ctl.set_faults("sideways", blackhole=True)
        await ctl.refuse(True)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection(LOOPBACK, port)
        await ctl.refuse(False)
        assert await client(port).ping()
    finally:
        proxy.stop()
    assert not proxy.proc.alive()


def test_proxy_cli_rejects_bad_addresses():
    r = subprocess.run([sys.executable, "-m", "chaos.proxy", "--listen", "nonsense", "--upstream", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "host:port" in r.stderr
    r = subprocess.run([sys.executable, "-m", "chaos.proxy", "--listen", "0.0.0.0:9", "--upstream", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "loopback only" in r.stderr


async def test_proxy_host_process_hosts_proxies_with_the_fault_api(redis_server: RedisServer, tmp_path: Path):
    """The run's proxies live in their own process: a blackhole there stops a real Redis client,
    healing restores it, bad control calls are 400s, and stop ends the process."""
    from chaos.proxyhost import ProxyHost

    host = ProxyHost(tmp_path / "proxies")
    try:
        a = host.add("redis<-a", redis_server.port, seed=1)
        b = host.add("redis<-b", redis_server.port)
        assert a.port != b.port and a.url_host == f"{LOOPBACK}:{a.port}"
        ra, rb = client(a.port), client(b.port)
        try:
            assert await ra.ping() and await rb.ping()
            await a.set_faults("both", blackhole=True)
            with pytest.raises((RedisTimeoutError, RedisConnectionError)):
                await ra.ping()
            assert await rb.ping()  # the other proxy is untouched
            assert (await a.state())["faults"]["up"]["blackhole"] is True
            await a.heal()
            ra2 = client(a.port)
            assert await ra2.ping()
            await ra2.aclose()
            await a.set_faults("up", latency_ms=80)
            slow = client(a.port, timeout=5)
            t = time.monotonic()
            assert await slow.ping()
            assert time.monotonic() - t >= 0.07
            await slow.aclose()
            with pytest.raises(BadRequest):
                await a.set_faults("sideways", blackhole=True)
        finally:
            await ra.aclose()
            await rb.aclose()
        import httpx

        async with httpx.AsyncClient() as c:
            assert (await c.post(host.control + "/proxies/99/heal")).status_code == 400
            assert (await c.post(host.control + "/proxies", json={"upstreamPort": 0})).status_code == 400
    finally:
        host.stop()
    assert not host.alive()
