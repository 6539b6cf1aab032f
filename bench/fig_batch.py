"""Figure 1: batch admission decisions/s vs redis-benchmark running the token-bucket script
(EVALSHA, pipelined -P 16) against the same Redis."""

from __future__ import annotations

import subprocess

from leasehold.local.procs import RedisServer
from region_agent.store.lua_loader import DEFAULT_LUA_DIR, load_scripts

from .context import Ctx
from .harness import CpuMeter, degraded_counts, delta, loadgen, redis_client, services, start_agent
from .stats import Goal, Row, median

# the Northstar read-user rule: capacity 20 tokens, 2 per second, cost 1 (millitokens), slack 5 s
TB_ARGS = ("20000", "2000", "1000", "1000", "5000")


def redis_benchmark_script(server: RedisServer, requests: int, clients: int = 8, pipeline: int = 16,
                           keyspace: int = 10_000, timeout: float = 60.0) -> float:
    """Script calls/s of ``redis-benchmark`` running token_bucket.lua by EVALSHA over random keys."""
    script = load_scripts(DEFAULT_LUA_DIR)["token_bucket"]
    r = redis_client(server)
    try:
        sha = r.script_load(script.source)
    finally:
        r.close()
    assert sha == script.sha
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(server.port), "-c", str(clients),
                          "-P", str(pipeline), "-n", str(requests), "-r", str(keyspace), "--csv",
                          "EVALSHA", sha, "1", "rl:bench:tb:{__rand_int__}", *TB_ARGS],
                         capture_output=True, text=True, timeout=timeout, check=True)
    last = [ln for ln in out.stdout.splitlines() if ln.startswith('"EVALSHA')][-1]
    return float(last.split(",")[1].strip('"'))


def run(ctx: Ctx) -> list[Row]:
    redis = RedisServer(ctx.work / "fig1-redis").start()
    with services(redis):
        agent = start_agent(ctx.work / "fig1-agent", redis.url, extra=ctx.agent_args)
        with services(agent):
            subject, ceiling, cpu, share, cpu_us, util, ceiling_cpu_us, fallback, degraded = [], [], [], [], [], [], [], [], []
            r = redis_client(redis)
            for t in range(ctx.trials):
                before = degraded_counts(agent)
                with CpuMeter({"agent": agent.proc.pid}, r) as meter:
                    res = loadgen({"port": agent.port, "path": "/v1/admit/batch", "workload": "admit_batch",
                                   "workload_args": {"size": ctx.batch_size, "principals": ctx.principals,
                                                     "tag": f"f1t{t}"},
                                   "items_per_request": ctx.batch_size, "count": '"allowed":true', "conns": 4,
                                   "duration_s": ctx.duration_s, "warmup_s": ctx.warmup_s, "max_requests": 1_000_000})
                cpu_us.append(meter.per(res["sent"] * ctx.batch_size))  # whole run, warm-up included
                util.append(meter.utilisation())
                degraded.append(delta(degraded_counts(agent), before))
                if res["non200"] or res["errors"]:
                    ctx.note(f"fig1 trial {t}: {res['non200']} non-200 answers, errors {res['error_samples']}")
                subject.append(res["items_per_s"])
                cpu.append(res["cpu_pct"])
                share.append(res["counted"] / max(1, res["ok"] * ctx.batch_size))
                fallback.append(res["fallback"] / max(1, res["ok"] * ctx.batch_size))
                n = max(20_000, int(ceiling[-1] * ctx.duration_s) if ceiling else 100_000)
                with CpuMeter({}, r) as bm:
                    ceiling.append(redis_benchmark_script(redis, n))
                ceiling_cpu_us.append(bm.per(n)["redis"])
            r.close()
    return [Row("1", "batch admission (POST /v1/admit/batch, 100/batch)", median(subject), "decisions/s",
                median(ceiling), "redis-benchmark EVALSHA token_bucket -P16", Goal(">=", 0.40),
                extra={"trials": subject, "ceiling_trials": ceiling, "loadgen_cpu_pct": cpu, "allowed_share": share, "fallback_share": fallback, "degraded_by_reason": degraded,
                       "cpu_us_per_decision": cpu_us, "cpu_utilisation": util,
                       "ceiling_redis_cpu_us_per_call": ceiling_cpu_us})]
