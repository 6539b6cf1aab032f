"""The Redis circuit breaker on a real store: it opens after consecutive failures (decisions
then degrade at once, without touching the store), probes after the cool-down and closes when
the store is back."""

import asyncio

from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings


def breaker_state(metrics: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith("leasehold_agent_breaker_state{"))
    return float(line.split()[1])


async def test_breaker_opens_on_a_dead_store_and_closes_when_it_returns(tmp_path, policy_file):
    redis = RedisServer(tmp_path / "redis").start()
    settings = make_settings(redis.url, policy_file, breaker_failures=3, breaker_open_ms=300,
                             decision_budget_ms=500)
    app = create_app(settings, pepper=PEPPER)
    try:
        async with AsyncTestClient(app=app) as agent:
            ok = (await agent.post("/v1/admit", json=admit_body("brk-0000-ok"))).json()
            assert ok["allowed"] and not ok["fallback"]
            assert breaker_state((await agent.get("/metrics")).text) == 0
            redis.stop()
            got = [(await agent.post("/v1/admit", json=admit_body(f"brk-down-{i:04d}"))).json() for i in range(6)]
            assert all(d["fallback"] for d in got)  # P-READ falls back to its local bucket
            metrics = (await agent.get("/metrics")).text
            assert breaker_state(metrics) == 2  # open
            assert 'reason="STORE_UNREACHABLE"' in metrics
            redis.start()  # same port
            await asyncio.sleep(0.4)  # past the cool-down: the next call is a probe
            back = (await agent.post("/v1/admit", json=admit_body("brk-back-0001"))).json()
            assert back["allowed"] and not back["fallback"]
            assert breaker_state((await agent.get("/metrics")).text) == 0  # closed again
    finally:
        redis.stop()


async def test_a_store_outage_at_low_traffic_opens_the_breaker_and_keeps_it_reported_open(tmp_path, policy_file):
    """LeaseholdFallbackShareHigh leaves fewer than 30 fallback decisions in 5 minutes to
    LeaseholdBreakerOpen (docs/runbooks.md): the breaker counts failed decisions in a row however
    far apart they are, and between two of them — each, once the cool-down has passed, a half-open
    probe that fails — the gauge a scrape reads stays at open (2), so its ``max_over_time`` keeps
    the alert's ``for:``. Decisions here come three cool-downs apart."""
    redis = RedisServer(tmp_path / "redis").start()
    settings = make_settings(redis.url, policy_file, breaker_failures=3, breaker_open_ms=100,
                             decision_budget_ms=500, store_health_ms=0)
    app = create_app(settings, pepper=PEPPER)
    try:
        async with AsyncTestClient(app=app) as agent:
            assert not (await agent.post("/v1/admit", json=admit_body("sparse-ok"))).json()["fallback"]
            redis.stop()
            states = []
            for i in range(6):
                await asyncio.sleep(0.3)
                d = (await agent.post("/v1/admit", json=admit_body(f"sparse-down-{i:04d}"))).json()
                assert d["fallback"], d
                for _ in range(3):  # scrapes between this decision and the next, past the cool-down
                    states.append(breaker_state((await agent.get("/metrics")).text))
                    await asyncio.sleep(0.1)
            assert states[:6] == [0] * 6, states  # two failures: still closed
            assert states[6:] == [2] * 12, states  # the third opened it; every later probe failed
    finally:
        redis.stop()
