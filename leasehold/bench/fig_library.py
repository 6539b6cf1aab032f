"""Figure 3: library mode — the agent's decision engine called in process (real store gateway,
coalescing batcher, no HTTP) vs the ``limits`` package (moving window and sliding-window counter,
redis-py async storage) on the same Redis with the same number of concurrent callers."""

from __future__ import annotations

import msgspec

from leasehold.procs import RedisServer
from leasehold.topology import DEV_PEPPER
from region_agent.engine import Engine
from region_agent.keys import KeyBuilder
from region_agent.metrics import AgentMetrics
from region_agent.models import AdmitRequest
from region_agent.policy import PolicyHolder
from region_agent.store import scripts as sc
from region_agent.store.client import make_client
from region_agent.store.gateway import StoreGateway

from .context import Ctx
from .harness import NORTHSTAR, drive, services
from .stats import Goal, Row, median
from .workloads import admit_item

CONCURRENCY = 64


async def make_engine(redis_url: str) -> tuple[Engine, StoreGateway]:
    holder = PolicyHolder.load(str(NORTHSTAR))
    store = StoreGateway(make_client(redis_url, max_connections=32), sc.Scripts())
    await store.load()
    engine = Engine(get_bundle=lambda: holder.bundle, keys=KeyBuilder(DEV_PEPPER.encode()), store=store,
                    metrics=AgentMetrics())
    return engine, store


def requests(n: int, principals: int, tag: str) -> list[AdmitRequest]:
    return [msgspec.convert(admit_item(i, principals, tag), AdmitRequest) for i in range(n)]


async def engine_rate(redis_url: str, reqs: list[AdmitRequest], duration_s: float) -> float:
    engine, store = await make_engine(redis_url)
    try:
        n = len(reqs)
        done, secs = await drive(lambda i: engine.admit(reqs[i % n]), concurrency=CONCURRENCY,
                                 duration_s=duration_s, max_ops=5_000_000)
    finally:
        await store.close()
    return done / secs


async def limits_rate(redis_url: str, strategy: str, ids: list[str], duration_s: float) -> float:
    from limits import RateLimitItemPerSecond
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

    storage = RedisStorage("async+" + redis_url, implementation="redispy")
    limiter = (MovingWindowRateLimiter if strategy == "moving_window" else SlidingWindowCounterRateLimiter)(storage)
    item = RateLimitItemPerSecond(2, 10)  # read-user-v3's rate: 20 per 10 s
    n = len(ids)
    try:
        done, secs = await drive(lambda i: limiter.hit(item, ids[i % n]), concurrency=CONCURRENCY,
                                 duration_s=duration_s, max_ops=5_000_000)
    finally:
        await storage.reset()
    return done / secs


def run(ctx: Ctx) -> list[Row]:
    import uvloop

    redis = RedisServer(ctx.work / "fig3-redis").start()
    out: dict[str, list[float]] = {"engine": [], "moving_window": [], "sliding_window_counter": []}
    with services(redis):
        ids = [f"{d['tenantId'] if 'tenantId' in d else 'anon'}:{d['principal']['id']}"
               for d in (admit_item(i, ctx.principals) for i in range(ctx.principals))]

        async def trials() -> None:
            for t in range(ctx.trials):
                reqs = requests(ctx.principals, ctx.principals, f"f3t{t}")
                await engine_rate(redis.url, reqs[:200], 0.2)  # warm the scripts and the pool
                out["engine"].append(await engine_rate(redis.url, reqs, ctx.duration_s))
                for strat in ("moving_window", "sliding_window_counter"):
                    out[strat].append(await limits_rate(redis.url, strat, ids, ctx.duration_s))

        uvloop.run(trials())
    eng = median(out["engine"])
    return [Row("3", f"library mode ({CONCURRENCY} tasks) vs limits {strat.replace('_', ' ')}", eng,
                "decisions/s", median(out[strat]), f"limits {strat} (redis-py async)", Goal(">=", 2.0),
                extra={"trials": out["engine"], "ceiling_trials": out[strat]})
            for strat in ("moving_window", "sliding_window_counter")]
