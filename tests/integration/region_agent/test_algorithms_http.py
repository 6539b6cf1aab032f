"""The worked numbers of the window algorithms and GCRA through the agent's HTTP API, on a real
standalone Redis and a real Redis Cluster (the ``topology`` fixture).

Times come from the store's clock: a test writes state against Redis TIME and brackets the
answer between the clock before and after the call (the exact millisecond values are pinned by
the script tests in ``tests/integration/scripts``); the HTTP-facing numbers are exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from kernel.bundle import make_rule
from region_agent.decision.keys import KeyBuilder, parse_ip
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.policies import northstar, write_bundle
from tests.support.redis_buckets import store_now_ms, user_key

EXTRA = [
    make_rule(id="audit-log", scope="user", route_group="audit", algorithm="sliding_log", limit=20, window_ms=10_000,
         fail_mode="open"),
    make_rule(id="search-counter", scope="user", route_group="search", algorithm="sliding_counter", limit=20,
         window_ms=1_000, fail_mode="open"),
    make_rule(id="read-gcra", scope="user", route_group="gread", algorithm="gcra", capacity_millis=20_000,
         refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="open"),
]


@pytest.fixture
def r(store_client):
    return store_client


@pytest.fixture
async def agent2(topology, tmp_path: Path):
    policy = tmp_path / "algos.json"
    base = northstar()
    write_bundle(policy, base, rules=[*base.rules, *EXTRA])
    async with AsyncTestClient(app=create_app(make_settings(topology.agent_url, policy), pepper=PEPPER)) as client:
        yield client


admit = admit_json


async def away_from_boundary(r, window_ms: int, margin_ms: int) -> int:
    left = window_ms - await store_now_ms(r) % window_ms
    if left < margin_ms:
        await asyncio.sleep((left + 5) / 1000)
    t = await store_now_ms(r)
    return t - t % window_ms


def anon_key(ip: str) -> str:
    kb = KeyBuilder(PEPPER)
    anon = next(x for x in northstar().rules if x.id == "anon-login")
    addr = parse_ip(ip)
    return kb.rule_key(anon, tenant=None, user_id=None, api_key_id=None, route_group="login",
                       ip_tag=kb.ip_tag(addr, [anon]), addr=addr)


async def test_fixed_window_boundary_p_anon(agent2, r):
    """P-ANON (docs/invariants.md): 20 at the end of one window and 20 more at the start of the next are all admitted."""
    key = anon_key("203.0.113.9")
    body = {"tenant": None, "ptype": "anonymous", "pid": "203.0.113.9", "route": "login", "api_key": None}
    for attempt in range(3):  # a scenario that straddled a window boundary (a stalled machine) is re-run
        start = await away_from_boundary(r, 10_000, 1_000)
        await r.hset(key, mapping={"w": start, "n": 20})
        t0 = await store_now_ms(r)
        d = await admit(agent2, f"anon-21st-{attempt:03d}", **body)
        t1 = await store_now_ms(r)
        stored = int(await r.hget(key, "n"))
        # the previous window's 20 do not count in the new one: 20 more admitted, the 21st denied
        await r.hset(key, mapping={"w": start - 10_000, "n": 20})
        got = [await admit(agent2, f"anon-next-{attempt}-{i:03d}", **body) for i in range(21)]
        if await store_now_ms(r) - start < 10_000:
            break
    assert (d["allowed"], d["remaining"]) == (False, 0)
    assert start + 10_000 - t1 <= d["retryAfterMs"] <= start + 10_000 - t0  # the ms left in the window
    assert d["headers"]["Retry-After"] == str(-(-d["retryAfterMs"] // 1000))
    assert stored == 20  # the denial wrote nothing
    assert [g["allowed"] for g in got] == [True] * 20 + [False]
    assert 0 < await r.pttl(key) <= 10_000 + 5_000


async def test_sliding_log_hint_is_10000_ms(agent2, r):
    """A sliding log: 20 admitted just now in a 10 s log; the 21st waits for the oldest: 10,000 ms."""
    key = user_key("atlas", "U-17", "audit")
    for attempt in range(3):  # re-run if a stalled machine made the call take a second or more
        await r.delete(key)
        t = await store_now_ms(r)
        await r.zadd(key, {f"r{i}": t for i in range(20)})
        d = await admit(agent2, f"audit-21st-{attempt:03d}", route="audit")
        t1 = await store_now_ms(r)
        if t1 - t < 1_000:  # the whole seconds of the hint (Retry-After: 10) are those of a call under 1 s
            break
    # 10,000 ms minus the time the call itself took (exact to the ms in the script tests)
    assert d["allowed"] is False and t + 10_000 - t1 <= d["retryAfterMs"] <= 10_000
    assert d["headers"]["Retry-After"] == "10" and d["headers"]["RateLimit"] == '"audit-log";r=0;t=10'
    assert await r.zcard(key) == 20  # the denial added nothing
    # a retry of an admitted decision id is a replay: allowed, no second entry
    await r.zadd(key, {"audit-old-1": t})
    await r.zrem(key, "r0")
    again = await admit(agent2, "audit-old-1", route="audit")
    assert again["allowed"] is True and await r.zcard(key) == 20


async def test_sliding_counter_18_5_at_a_quarter_window(agent2, r):
    """A sliding window counter scaled to a 1 s window: prev 18, cur 5, >= 250 ms in: 18 x 0.75 + 5 + 1 = 19.5 <= 20."""
    key = user_key("atlas", "U-17", "search")
    start = t0 = 0
    t1 = 1_000
    for attempt in range(5):  # re-run when a stalled machine put the call outside [250, 1,000) ms of one window
        t = await store_now_ms(r)
        if not 250 <= t % 1_000 <= 700:
            await asyncio.sleep(((250 - t % 1_000) % 1_000 + 5) / 1_000)
        t0 = await store_now_ms(r)
        start = t0 - t0 % 1_000
        if t0 - start < 250:  # the sleep overshot into the next window's first quarter
            continue
        await r.hset(key, mapping={"w": start, "cur": 5, "prev": 18})
        d = await admit(agent2, f"search-{attempt:04d}", route="search")
        t1 = await store_now_ms(r)
        if t1 - start < 1_000:
            break
    assert 250 <= t0 - start and t1 - start < 1_000, "every attempt crossed the window boundary"
    assert d["allowed"] is True
    assert await r.hmget(key, "cur", "prev") == [b"6", b"18"]
    # a full-weight previous window (stored window ahead: elapsed 0): 18 + 1 + 1 = 20 allowed, then denied
    await r.hset(key, mapping={"w": start + 5_000, "cur": 1, "prev": 18})
    assert (await admit(agent2, "search-0102", route="search"))["allowed"] is True
    denied = await admit(agent2, "search-0103", route="search")
    assert denied["allowed"] is False and denied["deniedScope"] == "user" and denied["headers"]["Retry-After"]


async def test_gcra_21st_request_waits_500_ms(agent2, r):
    key = user_key("atlas", "U-17", "gread")
    for attempt in range(3):  # re-run if the 21 calls took 500 ms or more (a stalled machine): one more is due
        await r.delete(key)
        t0 = await store_now_ms(r)
        got = [await admit(agent2, f"gcra-{attempt}-{i:03d}", route="gread") for i in range(21)]
        if await store_now_ms(r) - t0 < 500:
            break
    assert [g["allowed"] for g in got] == [True] * 20 + [False]
    assert 0 < got[-1]["retryAfterMs"] <= 500 and got[-1]["headers"]["Retry-After"] == "1"
    # the theoretical arrival time 10 s ahead of the store clock: 500 ms minus the call's own time
    for attempt in range(3):  # re-run if the call took 500 ms or more: it would then be admitted
        t = await store_now_ms(r)
        await r.set(key, t + 10_000)
        d = await admit(agent2, f"gcra-x-{attempt:03d}", route="gread")
        t1 = await store_now_ms(r)
        if t1 - t < 500:
            break
    assert d["allowed"] is False and 500 - (t1 - t) <= d["retryAfterMs"] <= 500
    assert d["headers"] == {"Retry-After": "1", "RateLimit-Policy": '"read-gcra";q=20;w=10',
                            "RateLimit": '"read-gcra";r=0;t=1'}
