"""A pool rule's in-process allowance while the agent's Redis is unreachable (docs/bound.md, counted
per allocator window and never evicted): ``fallbackPerRegion`` per agent and per pool window *as the allocator numbers it* (wall-clock
windows here, the allocator's clock on this machine), never per window of the agent's monotonic
clock, and never reset by the eviction of other local fallback states. A real agent process whose
Redis URL points at a port nothing listens on (the store is down from the start)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Bundle, Fallback, Pool, Rule, make_rule, seal
from leasehold.local.procs import free_port
from tests.support.agent import agent_process
from tests.support.policies import write_bundle
from tests.support.windows import clear_of_window_edges_sync

F = 4


def _mono_phase_window() -> int:
    """A pool window length (ms) for which a window of this host's monotonic clock starts near the
    middle of a wall-clock window: an allowance aligned on the monotonic clock would then give
    2 x F inside one wall-clock window."""
    offset = time.time() * 1000 - time.monotonic() * 1000
    best, score = 1_000, -1.0
    for w in range(1_000, 2_001, 25):
        phase = (offset % w) / w
        s = min(phase, 1 - phase)
        if s > score:
            best, score = w, s
    return best


W_MONO = _mono_phase_window()
MONO = Pool(id="mono-w", window_ms=W_MONO, limit=1_000, fallback_per_region=F, chunk_min=1, chunk_max=10,
            prefetch_ms=100)
LRU = Pool(id="lru-w", window_ms=60_000, limit=1_000, fallback_per_region=F, chunk_min=1, chunk_max=10)
USER = make_rule(id="user-all", scope="user", algorithm="token_bucket", capacity_millis=1_000_000, refill_millis=1_000_000,
            period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded",
            fallback=Fallback(capacity_millis=200_000, refill_millis=1_000, period_ms=60_000))


def _pool_rule(tenant: str, pool: str) -> Rule:
    return make_rule(id=f"tenant-{tenant}-pool", scope="tenant", tenant=tenant, algorithm="pool", pool=pool,
                fail_mode="local_bounded")


@pytest.fixture(scope="module")
def redisless_agent(tmp_path_factory: pytest.TempPathFactory):
    run = Path(tmp_path_factory.mktemp("local-allowances"))
    bundle = seal(Bundle(bundle_version=3, published_at="2026-11-30T00:00:00Z", checksum="",
                         rules=[USER, _pool_rule("mono", MONO.id), _pool_rule("lru", LRU.id)], pools=[MONO, LRU]))
    # tenant "free" has only the user rule: its users' fallback buckets are the other local states
    policy = run / "bundle.json"
    write_bundle(policy, bundle)
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with agent_process(run / "agent", dead_redis, policy, "--fallback-max-keys", "3", "--decision-budget-ms", "50",
                       ready_path="/healthz") as (url, _proc):
        yield url


def _admit(client: httpx.Client, url: str, tenant: str, user: str) -> tuple[int, int, dict]:
    body = {"requestId": f"r-{time.time_ns()}", "tenantId": tenant, "principal": {"type": "user", "id": user},
            "routeGroup": "read", "method": "GET"}
    s = int(time.time() * 1000)
    resp = client.post(url + "/v1/admit", json=body)
    e = int(time.time() * 1000)
    assert resp.status_code == 200, resp.text
    return s, e, resp.json()


def _per_window(recs: list[tuple[int, int, dict]], w: int) -> Counter:
    c: Counter = Counter()
    for s, e, d in recs:
        if d["allowed"] and s // w == e // w:
            assert d["fallback"], d
            c[s // w] += 1
    return c


def test_pool_allowance_counts_per_allocator_window_not_monotonic(redisless_agent):
    url = redisless_agent
    recs = []
    now = time.time() * 1000  # start just after a wall-clock window starts (a monotonic one starts mid-way)
    time.sleep(((now // W_MONO + 1) * W_MONO + 30 - now) / 1000)
    with httpx.Client(timeout=10) as client:
        end = time.monotonic() + 3.2 * W_MONO / 1000
        while time.monotonic() < end:  # ~25 requests per second, one user
            recs.append(_admit(client, url, "mono", "U-0"))
            time.sleep(0.04)
    got = _per_window(recs, W_MONO)
    assert got and max(got.values()) <= F, f"window {W_MONO} ms: admitted per wall-clock window {dict(got)} > {F}"
    assert sum(got.values()) >= F  # the allowance really admitted


def test_pool_allowance_is_not_reset_by_evicting_other_states(redisless_agent):
    url = redisless_agent
    # the F + 2 requests below must count in one window: before any grant the agent places a decision
    # on the allocator's clock give or take 1 s (one near a boundary is charged to both windows), so
    # they start 1.5 s past a boundary with seconds to spare (a slow machine) before the next one's
    clear_of_window_edges_sync(LRU.window_ms, before_ms=6_000, after_ms=1_500)
    with httpx.Client(timeout=10) as client:
        recs = [_admit(client, url, "lru", "U-0") for _ in range(F + 2)]
        assert [d["allowed"] for _, _, d in recs] == [True] * F + [False] * 2, recs
        # other tenants' users, more than --fallback-max-keys: their admitted fallback buckets evict
        # older local states
        for i in range(12):
            _, _, d = _admit(client, url, "free", f"U-{i}")
            assert d["allowed"] and d["fallback"] and d["remaining"] == 199, d
        _, _, again = _admit(client, url, "free", "U-0")
        assert again["remaining"] == 199, "--fallback-max-keys 3: U-0's local bucket was evicted (it starts full again)"
        recs += [_admit(client, url, "lru", f"U-{i}") for i in range(12)]
    got = _per_window(recs, LRU.window_ms)
    assert max(got.values()) <= F, f"admitted per window {dict(got)} > {F} after evictions"
