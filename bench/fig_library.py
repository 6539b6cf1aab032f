"""Figure 3: library mode — the agent's decision engine called in process (real Redis node,
coalescing batcher, no HTTP) vs the ``limits`` package (moving window and sliding-window counter,
redis-py async storage) on the same Redis with the same number of concurrent callers."""

from __future__ import annotations

from leasehold.local.procs import RedisServer
from leasehold.local.topology import DEV_PEPPER
from region_agent.decision.engine import DecisionEngine
from region_agent.decision.keys import KeyBuilder
from region_agent.models import AdmitRequest, Principal
from region_agent.service.metrics import AgentMetrics
from region_agent.service.policy import PolicyHolder
from region_agent.store import scripts as sc
from region_agent.store.client import make_client
from region_agent.store.node import RedisNode

from .context import Ctx
from .harness import NORTHSTAR, drive, services
from .stats import Goal, Row, median

CONCURRENCY = 64


async def make_engine(redis_url: str) -> tuple[DecisionEngine, RedisNode]:
    holder = PolicyHolder.load(str(NORTHSTAR))
    store = RedisNode(make_client(redis_url, max_connections=32), sc.Scripts())
    await store.load()
    engine = DecisionEngine(get_snapshot=lambda: holder.snapshot, keys=KeyBuilder(DEV_PEPPER.encode()), store=store,
                    metrics=AgentMetrics())
    return engine, store


def user_requests(n: int, tag: str) -> list[AdmitRequest]:
    """One read request per user of a tenant without tenant rules: only read-user-v3 (20 tokens,
    2/s) applies, one key per principal — the same rule and key count the ``limits`` side gets."""
    return [AdmitRequest(request_id=f"{tag}-{i:010d}", principal=Principal(type="user", id=f"user-{i}"),
                         route_group="read", tenant_id="scale") for i in range(n)]


async def engine_rate(redis_url: str, reqs: list[AdmitRequest], duration_s: float) -> tuple[float, float]:
    """(decisions/s, share allowed) of the engine over the request mix."""
    engine, store = await make_engine(redis_url)
    allowed = 0

    async def one(i: int) -> None:
        nonlocal allowed
        d = await engine.admit(reqs[(i * step) % n])
        allowed += d.allowed

    try:
        n = len(reqs)
        step = 7919  # scattered order over the principals
        done, secs = await drive(one, concurrency=CONCURRENCY, duration_s=duration_s, max_ops=5_000_000)
    finally:
        await store.close()
    return done / secs, allowed / max(done, 1)


async def limits_rate(redis_url: str, strategy: str, ids: list[str], duration_s: float) -> float:
    from limits import RateLimitItemPerSecond
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

    storage = RedisStorage("async+" + redis_url, implementation="redispy")
    limiter = (MovingWindowRateLimiter if strategy == "moving_window" else SlidingWindowCounterRateLimiter)(storage)
    item = RateLimitItemPerSecond(20, 10)  # read-user-v3: 20 tokens, 2 per second
    n = len(ids)
    try:
        done, secs = await drive(lambda i: limiter.hit(item, ids[(i * 7919) % n]), concurrency=CONCURRENCY,
                                 duration_s=duration_s, max_ops=5_000_000)
    finally:
        await storage.reset()
    return done / secs


def run(ctx: Ctx) -> list[Row]:
    import uvloop

    redis = RedisServer(ctx.work / "fig3-redis").start()
    out: dict[str, list[float]] = {"engine": [], "moving_window": [], "sliding_window_counter": []}
    shares: list[float] = []
    with services(redis):
        ids = [f"scale:user-{i}" for i in range(ctx.principals)]

        async def trials() -> None:
            for t in range(ctx.trials):
                reqs = user_requests(ctx.principals, f"f3t{t}")
                await engine_rate(redis.url, reqs[:200], 0.2)  # warm the scripts and the pool
                rate, share = await engine_rate(redis.url, reqs, ctx.duration_s)
                out["engine"].append(rate)
                shares.append(share)
                for strat in ("moving_window", "sliding_window_counter"):
                    out[strat].append(await limits_rate(redis.url, strat, ids, ctx.duration_s))

        uvloop.run(trials())
    eng = median(out["engine"])
    return [Row("3", f"library mode ({CONCURRENCY} tasks) vs limits {strat.replace('_', ' ')}", eng,
                "decisions/s", median(out[strat]), f"limits {strat} (redis-py async)", Goal(">=", 2.0),
                extra={"trials": out["engine"], "ceiling_trials": out[strat], "engine_allowed_share": shares})
            for strat in ("moving_window", "sliding_window_counter")]
