"""Figure 7 (regional half): decisions/s and Redis memory per active key at 1k, 10k, 100k active
keys, through the agent's engine in process (the same path as figure 3)."""

from __future__ import annotations

from leasehold.local.procs import RedisServer

from .context import Ctx
from .fig_library import CONCURRENCY, make_engine, user_requests
from .harness import drive, redis_client, services, used_memory
from .stats import Row

POPULATE_BATCH = 500


async def _measure(redis_url: str, reqs: list, duration_s: float, r) -> dict:
    engine, store = await make_engine(redis_url)
    try:
        r.flushall()
        mem0 = used_memory(r)
        for i in range(0, len(reqs), POPULATE_BATCH):
            await engine.admit_many(reqs[i:i + POPULATE_BATCH])
        keys = r.dbsize()
        mem1 = used_memory(r)
        n = len(reqs)
        step = 7919 if n % 7919 else 7907  # visit the keys in a scattered order
        allowed = 0

        async def one(i: int) -> None:
            nonlocal allowed
            d = await engine.admit(reqs[(i * step) % n])
            allowed += d.allowed

        done, secs = await drive(one, concurrency=CONCURRENCY, duration_s=duration_s, max_ops=5_000_000)
    finally:
        await store.close()
    return {"keys": keys, "bytes_per_key": (mem1 - mem0) / max(keys, 1), "rate": done / secs, "allowed_share": allowed / max(done, 1)}


def run(ctx: Ctx) -> list[Row]:
    import uvloop

    rows: list[Row] = []
    redis = RedisServer(ctx.work / "fig7-redis").start()
    with services(redis):
        r = redis_client(redis)
        try:
            for n in ctx.scale_keys:
                m = uvloop.run(_measure(redis.url, user_requests(n, f"s{n}"), ctx.duration_s, r))
                rows.append(Row("7", f"{n:,} active keys: decisions/s (engine, {CONCURRENCY} tasks)", m["rate"],
                                "decisions/s", extra=m))
                rows.append(Row("7", f"{n:,} active keys: Redis memory per key ({m['keys']:,} keys)",
                                m["bytes_per_key"], "bytes/key", extra=m))
        finally:
            r.close()
    return rows
