"""Approximate rules (kernel/approx.py) through three agents on one real redis-server: each counts
in process and reconciles with Redis; together they admit the limit and never more than
``limit + (agents - 1) x localMax`` per window, and after they stop, Redis holds what they admitted."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import msgspec
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from kernel.algorithms import make_rule
from kernel.algorithms.rule import Approximate
from kernel.approx import approximate_bound
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_json, make_settings
from tests.support.policies import northstar, write_bundle

AGENTS = 3
LIMIT, LOCAL_MAX, RECONCILE_MS, WINDOW_MS = 60, 5, 100, 3_600_000
KEY = "rl:v3:{t:atlas}:tenant:atlas:read:approx"

CEILING = make_rule(id="atlas-read-ceiling", scope="tenant", tenant="atlas", route_group="read",
                    algorithm="fixed_window", fail_mode="local_bounded", limit=LIMIT, window_ms=WINDOW_MS,
                    approximate=Approximate(reconcile_ms=RECONCILE_MS, local_max=LOCAL_MAX))


def bundle():
    b = northstar()
    return msgspec.structs.replace(b, rules=[*b.rules, CEILING])


async def window_index(r: Redis) -> int:
    sec, usec = await r.time()
    return (int(sec) * 1000 + int(usec) // 1000) // WINDOW_MS


async def test_three_agents_stay_within_the_bound_and_redis_ends_with_what_they_admitted(redis_url: str,
                                                                                        tmp_path: Path):
    policy = tmp_path / "approx.json"
    write_bundle(policy, bundle(), rules=bundle().rules)
    r = Redis.from_url(redis_url)
    first = await window_index(r)
    decisions: list[dict] = []
    async with contextlib.AsyncExitStack() as stack:
        agents = [await stack.enter_async_context(AsyncTestClient(app=create_app(make_settings(redis_url, policy),
                                                                                 pepper=PEPPER)))
                  for _ in range(AGENTS)]
        n = 0
        for _round in range(25):  # bounded: 25 rounds x 3 agents x 3 requests
            for agent in agents:
                for _ in range(3):
                    decisions.append(await admit_json(agent, f"approx-{n:05d}", pid=f"U-{n % 40}"))
                    n += 1
            await asyncio.sleep(RECONCILE_MS * 1.5 / 1000)  # let the reconcilers run
    # (leaving the clients ran each agent's shutdown: a last reconciliation flushed its counts)
    last = await window_index(r)
    windows = last - first + 1
    admitted = sum(d["allowed"] for d in decisions)
    bound = approximate_bound(CEILING, AGENTS).total
    assert bound == LIMIT + (AGENTS - 1) * LOCAL_MAX == 70
    assert LIMIT <= admitted <= bound * windows
    denied = [d for d in decisions if not d["allowed"]]
    assert denied and {(d["policyId"], d["deniedScope"], d["source"]) for d in denied} == {
        ("atlas-read-ceiling", "tenant", "approximate")}
    counts = {int(k): int(v) for k, v in (await r.hgetall(KEY)).items()}
    assert sum(counts.values()) == admitted  # every admitted unit reached Redis, none twice (no failures here)
    assert max(counts.values()) <= bound
    await r.aclose()
