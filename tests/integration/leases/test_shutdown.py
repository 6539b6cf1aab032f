"""SIGTERM and quiet logs on real processes (docs/operations.md): an agent told to stop stops asking
for leases, closes the leases it holds and reports them (the allocator returns the unspent rest at
once), then exits; with both services at log level info, neither logs a line per request — only
state changes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Pool
from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.agent import admit_body
from tests.support.policies import write_pools
from tests.support.windows import wait_for_window_start

from .conftest import etcd_grants, etcd_windows, pool_rule, user_rule, wall_ms

pytestmark = pytest.mark.integration

POOL = Pool(id="dune", window_ms=60_000, limit=10_000, lease_ttl_ms=15_000, chunk_max=50, chunk_min=5,
            fallback_per_region=10)
REQUEST_LINES = ("HTTP Request", "/v1/leases", "POST ", "GET ")


@pytest.fixture
def topo(tmp_path: Path):
    policy = write_pools(tmp_path / "bundle.json", [POOL], [user_rule(), pool_rule("dune", "dune")])
    t = LocalTopology(TopologySpec(run_dir=tmp_path / "run", policy=policy, regions=("eu",), allocators=1,
                              agent_args=("--lease-tick-ms", "50", "--policy-poll-ms", "0", "--log-level", "info",
                                          # as the other lease tests (conftest): a loaded machine's slow
                                          # script call is not taken for a Redis loss (the fallback)
                                          "--decision-budget-ms", "250"),
                              allocator_args=("--log-level", "info"))).start(timeout=60)
    yield t
    t.stop()


async def test_sigterm_reports_held_leases_and_logs_stay_quiet(topo: LocalTopology):
    url = topo.agent_urls["eu"][0]
    agent = topo.agents["eu"][0]
    # the 15 s leases must still be held at SIGTERM: they end with their 60 s window, so start with
    # at least 25 s of the window left (the burst below takes a few seconds on a busy machine)
    W = POOL.window_ms
    if (wall_ms() // W + 1) * W - wall_ms() < 25_000:
        await wait_for_window_start(W, after_ms=200)
    admitted = 0
    async with httpx.AsyncClient(timeout=5) as c:
        for i in range(600):  # bounded; 120 admissions needed
            d = (await c.post(url + "/v1/admit", json=admit_body(tenant="dune", pid=f"U-{i % 7}"))).json()
            # the allocator and Redis are reachable: never the fallback allowance
            if d["fallback"]:
                log = await asyncio.to_thread(Path(agent.log_path).read_text)
                pytest.fail(f"a fallback decision {d} with the allocator reachable; agent log: {log[-3000:]}")
            if d["allowed"]:
                admitted += 1
                if admitted == 120:
                    break
                continue
            # a burst can outrun the top-ups on a busy machine (the wait for one is bounded by the
            # decision budget): a 429 from the pool rule with a hint, then the next top-up pays
            assert d["policyId"] == "tenant-dune-pool" and d["httpStatus"] == 429, d
            await asyncio.sleep(min(d.get("retryAfterMs") or 50, 500) / 1000)
    assert admitted == 120
    grants = await etcd_grants(topo)
    # the leases bought for the burst are held (15 s); a warm-up lease from the start may have ended
    # and been reported already while the test waited for a fresh window
    held = {lid for lid, g in grants.items() if not g.reported and g.grant.granted > 0}
    assert held
    (k,) = {grants[lid].grant.window.index for lid in held}  # the burst's window
    # the region bought what the burst needed, not the pool: a burst at the start used to fill the
    # regional balance's 16 entries with chunkMin leases, and every refused deposit's grant stayed
    # out until its expiry while the next one was bought (the whole 10,000 held for 120 requests)
    bought = sum(g.grant.granted for g in grants.values() if g.grant.window.index == k)
    assert bought <= 120 + 16 * POOL.chunk_max, bought
    assert agent.popen is not None
    agent.signal(signal.SIGTERM)
    code = await asyncio.to_thread(agent.popen.wait, 20)  # raises if it does not exit in time
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it shut down
    # every lease the region held is reported (closed early), its unspent tokens back in the pool
    after = await etcd_grants(topo)
    assert set(after) == set(grants)  # no lease requested after SIGTERM that a report did not cover
    # (a zero grant, "nothing left", holds nothing and needs no report)
    assert all(g.reported for g in after.values() if g.grant.granted > 0), \
        [(lid, g) for lid, g in after.items() if not g.reported and g.grant.granted > 0]
    spent = sum(g.spent for g in after.values())
    # every unspent token is back: returned to its window, or stranded (a warm-up lease of the window
    # before, reported after that window closed); the burst's window is checked exactly below
    assert spent == 120
    assert sum(g.returned + g.stranded for g in after.values()) == sum(g.grant.granted for g in after.values()) - 120
    window = (await etcd_windows(topo, "dune"))[k]
    assert window.remaining == POOL.limit - 120 and window.spent == {"eu": 120}
    log = await asyncio.to_thread(Path(agent.log_path).read_text)
    assert f"shutdown: {len(held)} held leases closed, 0 usage reports not delivered" in log
    # quiet logs at info: no line per request in either service, only start/stop and state changes
    alloc_log = await asyncio.to_thread(Path(topo.allocators[0].log_path).read_text)
    for text in (log, alloc_log):
        lines = [ln for ln in text.splitlines() if any(m in ln for m in REQUEST_LINES)]
        assert lines == [], lines[:5]
    assert len(alloc_log.splitlines()) <= 15, alloc_log
