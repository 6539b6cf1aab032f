"""Figure 2: single POST /v1/admit under 64 concurrent keep-alive connections (req/s, p50/p99)
vs a bare Litestar echo of the same body on uvicorn with the same worker count, plus a sweep
over concurrency for the plot."""

from __future__ import annotations

from leasehold.procs import RedisServer

from .context import Ctx
from .harness import (
    CpuMeter,
    Service,
    degraded_counts,
    delta,
    loadgen,
    redis_client,
    services,
    start_agent,
    start_echo,
)
from .stats import Goal, Row, median

FIGURE_CONNS = 64


def _trial(ctx: Ctx, svc: Service, conns: int, tag: str, r=None) -> dict:
    before = degraded_counts(svc) if r is not None else {}
    with CpuMeter({"server": svc.proc.pid}, r) as meter:
        res = loadgen({"port": svc.port, "path": "/v1/admit", "workload": "admit", "count": '"allowed":true',
                       "workload_args": {"principals": ctx.principals, "tag": tag}, "conns": conns,
                       "duration_s": ctx.duration_s, "warmup_s": ctx.warmup_s, "max_requests": 2_000_000})
    res["cpu_us_per_request"] = meter.per(res["sent"])
    res["cpu_utilisation"] = meter.utilisation()
    res["degraded"] = delta(degraded_counts(svc), before) if r is not None else {}
    return res


def run(ctx: Ctx) -> list[Row]:
    workers = ctx.workers
    redis = RedisServer(ctx.work / "fig2-redis").start()
    with services(redis):
        agent = start_agent(ctx.work / "fig2-agent", redis.url, workers=workers, extra=ctx.agent_args)
        with services(agent):
            echo = start_echo(ctx.work / "fig2-echo", workers=workers)
            r = redis_client(redis)
            with services(echo):
                sweep: dict[str, dict[int, dict]] = {"agent": {}, "echo": {}}
                fig: dict[str, list[dict]] = {"agent": [], "echo": []}
                # the figure's trials first, so an earlier sweep level's state (e.g. an open circuit
                # breaker) does not carry into them; then the rest of the sweep for the plot
                for conns in [FIGURE_CONNS, *sorted(set(ctx.sweep) - {FIGURE_CONNS})]:
                    n = ctx.trials if conns == FIGURE_CONNS else 1
                    for t in range(n):
                        for name, svc in (("agent", agent), ("echo", echo)):
                            res = _trial(ctx, svc, conns, f"f2c{conns}t{t}", r if name == "agent" else None)
                            if res["non200"] or res["errors"]:
                                ctx.note(f"fig2 {name} c={conns}: {res['non200']} non-200, {res['error_samples']}")
                            if conns == FIGURE_CONNS:
                                fig[name].append(res)
                            else:
                                sweep[name][conns] = res
                for name in fig:
                    rs = sorted(fig[name], key=lambda r: r["rps"])
                    sweep[name][FIGURE_CONNS] = rs[len(rs) // 2]
            r.close()
    ctx.plot_data["fig2"] = {name: {str(c): {"rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                                             "fallback_share": r["fallback"] / max(1, r["ok"])}
                                    for c, r in sorted(per.items())} for name, per in sweep.items()}

    def med(name: str, key: str) -> float:
        return median(r[key] for r in fig[name])

    extra = {"workers": workers, "loadgen_cpu_pct": {k: [r["cpu_pct"] for r in v] for k, v in fig.items()},
             "trials_rps": {k: [r["rps"] for r in v] for k, v in fig.items()},
             "cpu_us_per_request": {k: [r["cpu_us_per_request"] for r in v] for k, v in fig.items()},
             "cpu_utilisation": {k: [r["cpu_utilisation"] for r in v] for k, v in fig.items()},
             "agent_allowed_share": [r["counted"] / max(1, r["ok"]) for r in fig["agent"]],
             "agent_degraded_by_reason": [r["degraded"] for r in fig["agent"]],
             "agent_fallback_share": [r["fallback"] / max(1, r["ok"]) for r in fig["agent"]]}
    return [
        Row("2", f"single admit, {FIGURE_CONNS} conns: throughput", med("agent", "rps"), "req/s",
            med("echo", "rps"), "bare Litestar echo", Goal(">=", 0.60), extra=extra),
        Row("2", f"single admit, {FIGURE_CONNS} conns: p50 latency", med("agent", "p50_ms"), "ms",
            med("echo", "p50_ms"), "bare Litestar echo"),
        Row("2", f"single admit, {FIGURE_CONNS} conns: p99 latency", med("agent", "p99_ms"), "ms",
            med("echo", "p99_ms"), "bare Litestar echo"),
    ]
