"""Chunks for a hot key set (region_agent.leasing.hot_chunks) on a real redis-server: the
decision engine with the agent's own store, store calls counted by the server itself
(``INFO commandstats``: every script call is one EVALSHA)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from kernel.algorithms import HotChunk
from kernel.bound import Topology, hot_chunk_term
from kernel.bundle import Bundle, encode_bundle, make_rule, seal, validate_bundle
from region_agent.decision.engine import DecisionEngine
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot
from region_agent.models import AdmitRequest, DecisionSource, Principal
from region_agent.service.metrics import AgentMetrics
from region_agent.store.factory import make_store
from tests.support.agent import PEPPER, make_settings
from tests.support.clock import FakeClock
from tests.support.windows import clear_of_window_edges

pytestmark = pytest.mark.integration

_ids = itertools.count()


def bundle_with(rule_fields: dict, hot: HotChunk) -> Bundle:
    rule = make_rule(id="hot-tenant", scope="tenant", tenant="hot", fail_mode="closed", hot_chunk=hot, **rule_fields)
    b = seal(Bundle(bundle_version=7, published_at="2026-12-01T00:00:00Z", checksum="", rules=[rule]))
    validate_bundle(b)
    return b


FW = {"algorithm": "fixed_window", "limit": 25, "window_ms": 60_000}


class Agent:
    """One agent process's decision engine over the real store."""

    def __init__(self, redis_url: str, bundle: Bundle, tmp: Path, clock: Callable[[], float] = time.monotonic):
        policy = tmp / f"bundle-{next(_ids)}.json"
        policy.write_bytes(encode_bundle(bundle))
        self.m = AgentMetrics()
        self.store = make_store(make_settings(redis_url, policy), self.m)
        self.store.start()
        snap = Snapshot(bundle)
        self.engine = DecisionEngine(get_snapshot=lambda: snap, keys=KeyBuilder(PEPPER), store=self.store,
                                     metrics=self.m, budget_ms=2_000, clock=clock)

    async def admit(self, cost: int = 1, user: str = "U-1"):
        return await self.engine.admit(AdmitRequest(
            request_id=f"r-{next(_ids):012d}", tenant_id="hot", principal=Principal(type="user", id=user),
            route_group="read", cost_hint=cost))

    def count(self, name: str, **labels: str) -> float:
        return self.m.registry.get_sample_value(name, labels) or 0.0

    @property
    def takes(self) -> dict[str, float]:
        return {o: self.count("leasehold_agent_hot_chunks_total", outcome=o)
                for o in ("taken", "partial", "denied", "error")}


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    r = Redis.from_url(redis_url)
    yield r
    await r.aclose()


async def evalsha_calls(r: Redis) -> int:
    """Script calls the server has run since the last CONFIG RESETSTAT (a first call that found
    the script not loaded yet, NOSCRIPT, ran nothing: not counted)."""
    st = (await r.info("commandstats")).get("cmdstat_evalsha", {})
    return int(st.get("calls", 0)) - int(st.get("failed_calls", 0))


async def test_a_key_set_below_the_threshold_asks_the_store_every_time(redis_url, redis, tmp_path):
    agent = Agent(redis_url, bundle_with(FW, HotChunk(threshold_per_s=1_000_000, chunk_max=10)), tmp_path)
    await redis.config_resetstat()
    for _ in range(8):
        d = await agent.admit()
        assert d.allowed and d.source == DecisionSource.SCRIPT
    assert await evalsha_calls(redis) == 8
    assert sum(agent.takes.values()) == 0


async def test_past_the_threshold_a_chunk_is_taken_and_admits_need_no_store_call(redis_url, redis, tmp_path):
    await clear_of_window_edges(FW["window_ms"], before_ms=5_000)  # every unit counted in one window
    # the attempt rate is counted over the engine's clock: the test's, so a stall does not spread the
    # five attempts over more than the second they are counted in
    agent = Agent(redis_url, bundle_with({**FW, "limit": 1_000},
                                         HotChunk(threshold_per_s=5, chunk_max=10, validity_ms=60_000)), tmp_path,
                  clock=FakeClock(time.monotonic()))
    await redis.config_resetstat()
    sources = [(await agent.admit()).source for _ in range(5)]
    assert sources == [DecisionSource.SCRIPT] * 4 + [DecisionSource.SCRIPT]  # the 5th crosses: its own take
    assert agent.takes["taken"] == 1
    calls = await evalsha_calls(redis)
    assert calls == 5
    served = [await agent.admit() for _ in range(30)]
    assert all(d.allowed for d in served)
    by_chunk = sum(d.source == DecisionSource.CHUNK for d in served)
    new_calls = await evalsha_calls(redis) - calls
    # every store call took a chunk of 10: one admission from it at once, nine without a call
    assert new_calls == agent.takes["taken"] - 1 == 3 and by_chunk == 27
    # the store counted every unit of every chunk: 4 calls + 4 chunks of 10 (one of which holds 1 more)
    key = [k async for k in redis.scan_iter("*hot*")]
    assert len(key) == 1
    assert int(await redis.hget(key[0], "n")) == 4 + 40


async def test_the_tail_of_a_window_is_a_partial_chunk_then_the_store_denies(redis_url, redis, tmp_path):
    await clear_of_window_edges(FW["window_ms"], before_ms=5_000)  # the 25 units of one window
    agent = Agent(redis_url, bundle_with(FW, HotChunk(threshold_per_s=1, chunk_max=10, validity_ms=60_000)),
                  tmp_path)
    answers = [await agent.admit() for _ in range(40)]
    allowed = [d for d in answers if d.allowed]
    assert len(allowed) == 25  # every unit the window had, none more (one agent: its chunks are all spent)
    assert agent.takes["partial"] >= 1
    denied = [d for d in answers if not d.allowed]
    assert denied[0].source == DecisionSource.SCRIPT  # the store's answer to the take that found nothing
    assert 0 < denied[0].retry_after_ms <= 60_000 and denied[0].http_status == 429
    assert all(d.retry_after_ms > 0 for d in denied)


async def test_a_chunk_past_its_validity_is_abandoned_and_counted(redis_url, redis, tmp_path):
    """The engine runs on a clock the test moves (the chunk's validity and the attempt rate are
    timed on it): no stall of the machine ends the validity before the test moves past it, nor
    leaves it running after. The store's window is Redis's own (a minute): kept clear of its edges."""
    await clear_of_window_edges(FW["window_ms"], before_ms=5_000)
    clock = FakeClock(time.monotonic())
    agent = Agent(redis_url, bundle_with({**FW, "limit": 1_000},
                                         HotChunk(threshold_per_s=1, chunk_max=10, validity_ms=150)), tmp_path,
                  clock=clock)
    for _ in range(3):
        await agent.admit()
    await agent.engine.hot.settled()  # a background take the admissions started has landed
    took = agent.takes["taken"] + agent.takes["partial"]
    assert took >= 1
    held = sum(c.usable(clock() * 1000) for c in agent.engine.hot.chunks.values())
    assert held >= 1 and agent.count("leasehold_agent_hot_chunk_abandoned_units_total") == 0
    clock.advance(0.3)  # the chunk's validity (150 ms) ends with units in it
    d = await agent.admit()
    assert d.allowed and d.source == DecisionSource.SCRIPT  # a fresh take answered it
    abandoned = agent.count("leasehold_agent_hot_chunk_abandoned_units_total")
    assert abandoned == held  # every unit it held, counted once
    key = [k async for k in redis.scan_iter("*hot*")][0]
    # the store charged everything taken, the abandoned units included: never refunded
    assert int(await redis.hget(key, "n")) >= 4 + abandoned


async def test_several_agents_stay_within_the_limit_plus_the_stated_overshoot(redis_url, redis, tmp_path):
    """A sliding log of 30 per second, chunks of at most 6, three agents driven together for about
    three seconds: no one-second span holds more admissions than 30 + the bound's hot-chunk term
    (3 agents x 6), counting only admissions surely inside the span (sent and answered in it)."""
    hot = HotChunk(threshold_per_s=1, chunk_max=6, validity_ms=400)
    bundle = bundle_with({"algorithm": "sliding_log", "limit": 30, "window_ms": 1_000}, hot)
    term = hot_chunk_term(bundle.rules[0], Topology.uniform(1, 3))
    assert term.tokens == 18
    agents = [Agent(redis_url, bundle, tmp_path) for _ in range(3)]
    admitted: list[tuple[float, float]] = []
    sources: list[DecisionSource] = []

    async def drive(a: Agent) -> None:
        end = time.monotonic() + 3.0
        for _ in range(3_000):  # bounded
            if time.monotonic() > end:
                return
            t0 = time.time()
            d = await a.admit()
            if d.allowed:
                admitted.append((t0, time.time()))
                sources.append(d.source)
            await asyncio.sleep(0.002)

    await asyncio.gather(*(drive(a) for a in agents))
    assert DecisionSource.CHUNK in sources
    assert len(admitted) > 30
    worst = 0
    for start, _ in admitted:
        inside = sum(1 for s, e in admitted if s >= start and e <= start + 1.0)
        worst = max(worst, inside)
    assert worst <= 30 + term.tokens, worst
    assert sum(a.takes["taken"] + a.takes["partial"] for a in agents) >= 1


async def test_a_batch_spends_the_chunk_a_single_admission_took(redis_url, redis, tmp_path):
    agent = Agent(redis_url, bundle_with({**FW, "limit": 1_000},
                                         HotChunk(threshold_per_s=1, chunk_max=20, validity_ms=60_000)), tmp_path)
    first = await agent.admit()
    assert first.allowed and agent.takes["taken"] == 1
    await redis.config_resetstat()
    takes = sum(agent.takes.values())
    reqs = [AdmitRequest(request_id=f"b-{i:012d}", tenant_id="hot", principal=Principal(type="user", id="U-1"),
                         route_group="read") for i in range(25)]
    got = await agent.engine.admit_many(reqs)
    assert all(d.allowed for d in got)
    assert sum(d.source == DecisionSource.CHUNK for d in got) == 19  # what the chunk held
    # the other six: their own calls in the batch's one submit (a batch does not take a chunk itself);
    # and the background take the chunk's low water started
    await agent.engine.hot.settled()
    background = sum(agent.takes.values()) - takes
    assert background == 1 and await evalsha_calls(redis) == 6 + background


async def test_chunks_on_a_redis_cluster(redis_cluster_url, tmp_path):
    """The take goes to the primary of the tenant's slot like the multi-rule call."""
    agent = Agent(redis_cluster_url.replace("redis://", "redis+cluster://"),
                  bundle_with(FW, HotChunk(threshold_per_s=1, chunk_max=10, validity_ms=60_000)), tmp_path)
    answers = [await agent.admit() for _ in range(30)]
    assert sum(d.allowed for d in answers) == 25
    assert sum(d.source == DecisionSource.CHUNK for d in answers) >= 15
    assert agent.takes["error"] == 0


async def test_a_key_in_many_key_sets_is_held_no_more_than_its_chunk_max(redis_url, tmp_path):
    """The tenant's bucket is in every user's key set: what one process holds of it in all its
    chunks together stays within the tenant rule's chunkMax (the bound's per-key term)."""
    tenant = make_rule(id="hot-tenant", scope="tenant", tenant="hot", fail_mode="closed", algorithm="sliding_log",
                       limit=1_000, window_ms=60_000, hot_chunk=HotChunk(threshold_per_s=1, chunk_max=12,
                                                                         validity_ms=60_000))
    user = make_rule(id="hot-user", scope="user", fail_mode="closed", algorithm="sliding_log", limit=1_000,
                     window_ms=60_000, hot_chunk=HotChunk(threshold_per_s=1, chunk_max=50, validity_ms=60_000))
    b = seal(Bundle(bundle_version=7, published_at="2026-12-01T00:00:00Z", checksum="", rules=[user, tenant]))
    validate_bundle(b)
    agent = Agent(redis_url, b, tmp_path)
    hot = agent.engine.hot
    for i in range(40):
        d = await agent.admit(user=f"U-{i % 4}")
        assert d.allowed
        await hot.settled()
        now = hot.now_ms()
        tenant_keys = {k for ks in hot.chunks for k in ks[0] if ":tenant:" in k}
        assert len(tenant_keys) == 1
        (key,) = tenant_keys
        held = sum(c.usable(now) for ks, c in hot.chunks.items() if key in ks[0])
        assert held <= 12, held
    assert sum(1 for ks in hot.chunks if hot.chunks[ks].usable(hot.now_ms())) >= 1
