"""Figure 5: a flood on one exhausted key through an agent; Redis script calls (INFO
commandstats evalsha delta) per admission attempt."""

from __future__ import annotations

from leasehold.local.procs import RedisServer

from .context import Ctx
from .harness import evalsha_calls, loadgen, redis_client, services, start_agent
from .stats import Goal, Row


def run(ctx: Ctx) -> list[Row]:
    flood = 5_000 if ctx.quick else 25_000
    redis = RedisServer(ctx.work / "fig5-redis").start()
    with services(redis):
        agent = start_agent(ctx.work / "fig5-agent", redis.url, extra=ctx.agent_args)
        with services(agent):
            base = {"port": agent.port, "path": "/v1/admit", "workload": "hot_key",
                    "workload_args": {"user": "hot-user", "tenant": "birch"}, "count": '"allowed":true'}
            # exhaust read-user-v3 (20 tokens) for the hot user first
            loadgen({**base, "workload_args": {**base["workload_args"], "tag": "h0"}, "conns": 1,
                     "duration_s": 10, "max_requests": 40})
            r = redis_client(redis)
            try:
                before = evalsha_calls(r)
                res = loadgen({**base, "workload_args": {**base["workload_args"], "tag": "h1"}, "conns": 64,
                               "duration_s": 2 * ctx.duration_s + 2, "max_requests": flood})
                calls = evalsha_calls(r) - before
            finally:
                r.close()
    attempts = res["ok"]
    if res["non200"] or res["errors"]:
        ctx.note(f"fig5: {res['non200']} non-200, {res['error_samples']}")
    per = calls / attempts if attempts else float("nan")
    return [Row("5", f"hot key flood ({attempts:,} attempts, {res['counted']} admitted): Redis calls/attempt",
                per, "calls/attempt", goal=Goal("<=", 0.05),
                extra={"redis_calls": calls, "attempts": attempts, "admitted": res["counted"],
                       "flood_s": res["elapsed_s"], "rps": res["rps"]})]
