"""Figure 2: single POST /v1/admit under 64 concurrent keep-alive connections (req/s, p50/p99)
against its real ceiling, a raw ASGI echo (uvicorn + httptools + uvloop, the same msgspec decode
and encode of ``AdmitRequest``, no framework: ``raw_echo``), with a bare Litestar echo of the same
body (``echo_app``) as a second reference, all with the same worker count; a sweep over
concurrency for the plot; and a cross-check of the load generator against ``wrk`` at 64
connections (agent and raw echo), so the ratio does not depend on our client."""

from __future__ import annotations

from leasehold.local.procs import RedisServer

from . import wrk
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
CEILING = "raw ASGI echo"
SECOND = "bare Litestar echo"


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
            raw = start_echo(ctx.work / "fig2-raw", workers=workers, module="bench.raw_echo")
            r = redis_client(redis)
            with services(echo, raw):
                targets = (("agent", agent), ("raw", raw), ("echo", echo))
                sweep: dict[str, dict[int, dict]] = {name: {} for name, _ in targets}
                fig: dict[str, list[dict]] = {name: [] for name, _ in targets}
                # the figure's trials first, so an earlier sweep level's state (e.g. an open circuit
                # breaker) does not carry into them; then the rest of the sweep for the plot
                for conns in [FIGURE_CONNS, *sorted(set(ctx.sweep) - {FIGURE_CONNS})]:
                    n = ctx.trials if conns == FIGURE_CONNS else 1
                    for t in range(n):
                        for name, svc in targets:
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
                cross = _cross_check(ctx, {"agent": agent, "raw": raw})
            r.close()
    ctx.plot_data["fig2"] = {name: {str(c): {"rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                                             "fallback_share": r["fallback"] / max(1, r["ok"])}
                                    for c, r in sorted(per.items())} for name, per in sweep.items()}

    def med(name: str, key: str) -> float:
        return median(r[key] for r in fig[name])

    extra = {"workers": workers, "loadgen_cpu_pct": {k: [r["cpu_pct"] for r in v] for k, v in fig.items()},
             "trials_rps": {k: [r["rps"] for r in v] for k, v in fig.items()},
             "trials_p99_ms": {k: [r["p99_ms"] for r in v] for k, v in fig.items()},
             "cpu_us_per_request": {k: [r["cpu_us_per_request"] for r in v] for k, v in fig.items()},
             "cpu_utilisation": {k: [r["cpu_utilisation"] for r in v] for k, v in fig.items()},
             "agent_allowed_share": [r["counted"] / max(1, r["ok"]) for r in fig["agent"]],
             "agent_degraded_by_reason": [r["degraded"] for r in fig["agent"]],
             "agent_fallback_share": [r["fallback"] / max(1, r["ok"]) for r in fig["agent"]],
             "wrk_cross_check": cross}
    rows = [
        Row("2", f"single admit, {FIGURE_CONNS} conns: throughput", med("agent", "rps"), "req/s",
            med("raw", "rps"), CEILING, Goal(">=", 0.55), extra=extra),
        Row("2", f"single admit, {FIGURE_CONNS} conns: p50 latency", med("agent", "p50_ms"), "ms",
            med("raw", "p50_ms"), CEILING),
        Row("2", f"single admit, {FIGURE_CONNS} conns: p99 latency", med("agent", "p99_ms"), "ms",
            med("raw", "p99_ms"), CEILING, Goal("<=", 3.0)),
        Row("2", f"single admit, {FIGURE_CONNS} conns: throughput vs {SECOND}", med("agent", "rps"), "req/s",
            med("echo", "rps"), SECOND),
        Row("2", f"single admit, {FIGURE_CONNS} conns: p99 latency vs {SECOND}", med("agent", "p99_ms"), "ms",
            med("echo", "p99_ms"), SECOND),
    ]
    if cross:
        rows.append(Row("2", f"single admit, {FIGURE_CONNS} conns, wrk: throughput", cross["agent"]["rps"], "req/s",
                        cross["raw"]["rps"], f"{CEILING} (wrk)"))
        rows.append(Row("2", f"single admit, {FIGURE_CONNS} conns, wrk: p99 latency", cross["agent"]["p99_ms"], "ms",
                        cross["raw"]["p99_ms"], f"{CEILING} (wrk)"))
    return rows


def _cross_check(ctx: Ctx, targets: dict[str, Service]) -> dict:
    """The agent and the raw echo at the figure's concurrency again, loaded by ``wrk`` instead of
    ``loadgen.py`` (after a load-generator warm-up): the two clients' ratios should agree."""
    if not wrk.available():
        ctx.note("fig2: wrk is not installed (make bench installs it): no load-generator cross-check")
        return {}
    out = {}
    for name, svc in targets.items():
        out[name] = wrk.run_wrk(svc.port, ctx.work / "fig2-wrk", conns=FIGURE_CONNS, duration_s=max(2.0, ctx.duration_s),
                                principals=ctx.principals, tag=f"wrk{name}")
        if out[name]["non2xx"] or out[name]["errors"]:
            ctx.note(f"fig2 wrk {name}: {out[name]['non2xx']} non-2xx, {out[name]['errors']} socket errors")
    return out
