"""The regional fallback allowance is counted per pool window *as the allocator numbers it*
(docs/bound.md), not per window of the regional Redis's clock. Real processes: etcd, an
allocator whose clock runs half a window ahead (libfaketime), a fault proxy that blackholes the
region's link to it, a redis-server and an agent (Redis and the agent on the host's clock).

With the allowance aligned on Redis TIME, an allocator window would see the tail of one Redis
window and the head of the next: up to 2 x fallbackPerRegion. It must see at most one."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from chaos.nemesis import faketime_env
from chaos.proxy import ProxyProcess
from kernel.bundle import Pool
from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, RedisServer, free_port, wait_http_ready
from leasehold.local.services import allocator_command

from .conftest import (
    FAST_ALLOCATOR,
    drive,
    pool_rule,
    start_agent,
    wall_ms,
    write_bundle,
)

POOL = Pool(id="skew-w", window_ms=4_000, limit=1_000, lease_ttl_ms=1_000, chunk_min=5, chunk_max=5,
            fallback_per_region=4, prefetch_ms=200, active_horizon_ms=4_000)
# The allocator's clock runs 3 s ahead of the host's: a window of Redis's clock (the host's) starts
# 3 s into each allocator window, after the region has been cut off and spent its allowance.
SKEW_MS = 3_000


@pytest.fixture
def skewed_allocator_region(tmp_path: Path):
    policy = write_bundle(tmp_path / "bundle.json", [POOL], [pool_rule("skew", POOL.id)])
    started: list = []
    try:
        etcd = EtcdCluster(tmp_path / "etcd").start()
        started.append(etcd)
        port = free_port()
        alloc = Proc("allocator-skewed", allocator_command(*FAST_ALLOCATOR, etcd=etcd.endpoints, policy=policy,
                                                           node_id="alloc-1", host=LOOPBACK, port=port,
                                                           auth_disabled=True),
                     tmp_path / "allocator", env=faketime_env(SKEW_MS / 1000)).start()
        started.append(alloc)
        wait_http_ready({f"http://{LOOPBACK}:{port}": alloc}, timeout=60)
        proxy = ProxyProcess((LOOPBACK, port), tmp_path / "proxy").start()
        started.append(proxy)
        redis = RedisServer(tmp_path / "redis").start()
        started.append(redis)
        agent, url = start_agent(tmp_path / "agent", policy, redis.url, f"http://{LOOPBACK}:{proxy.port}")
        started.append(agent)
        yield proxy, url
    finally:
        for x in reversed(started):
            x.stop()


async def test_regional_fallback_counts_per_allocator_window(skewed_allocator_region):
    proxy, url = skewed_allocator_region
    W, F = POOL.window_ms, POOL.fallback_per_region
    # allocator window k starts at host time k*W - SKEW_MS
    k = (wall_ms() + SKEW_MS) // W + 1
    await asyncio.sleep(max(0, k * W - SKEW_MS - 500 - wall_ms()) / 1000)
    stop = asyncio.Event()
    load = asyncio.create_task(drive({"eu": url}, "skew", seconds=20, per_second={"eu": 20}, stop=stop))
    try:
        await asyncio.sleep(max(0, k * W - SKEW_MS + 100 - wall_ms()) / 1000)
        await proxy.control.blackhole(on=True)  # cut off 0.1 s into allocator window k
        cut = wall_ms()
        await asyncio.sleep(max(0, (k + 2) * W - SKEW_MS - wall_ms()) / 1000)
    finally:
        stop.set()
        recs = await load
        await proxy.control.heal()
    assert (cut + SKEW_MS) // W == k
    fb: Counter = Counter()  # fallback admissions per allocator window (the allocator's clock: host + SKEW_MS)
    for r in recs:
        w = (r.sent_ms + SKEW_MS) // W
        if r.allowed and r.fallback and (r.recv_ms + SKEW_MS) // W == w:
            fb[w] += 1
    for w, n in fb.items():
        assert n <= F, f"allocator window {w}: {n} admitted from the regional allowance > {F} ({dict(fb)})"
    assert fb[k] >= 1 and fb[k + 1] >= F, fb  # the allowance really was spent in the cut-off windows
