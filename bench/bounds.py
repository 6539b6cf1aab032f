"""What bounds each figure, read from the CPU measured during it (pure: rows in, sentences out).

A process near 1.0 core is the bottleneck on these shared 2-core machines; the CPU spent per
decision on each side says where a faster design would have to save."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .stats import Row, median

BUSY = 0.7  # of one core: saturated, given 2 cores shared with the load generator, Redis and others


def _med(trials: Sequence[dict[str, float]], key: str) -> float | None:
    vals = [t[key] for t in trials if key in t]
    return median(vals) if vals else None


def _cores(util: Sequence[dict[str, float]]) -> str:
    keys = sorted({k for u in util for k in u})
    return ", ".join(f"{k} {_med(util, k):.2f} cores" for k in keys if k != "machine") + (
        f" (whole machine {_med(util, 'machine'):.2f} of {os.cpu_count()} cores busy)" if "machine" in keys else "")


def _who_busy(util: Sequence[dict[str, float]]) -> list[str]:
    keys = sorted({k for u in util for k in u} - {"machine"})
    return [k for k in keys if (_med(util, k) or 0) >= BUSY]


def _unsaturated(util: Sequence[dict[str, float]]) -> str:
    m = _med(util, "machine")
    if m is not None and os.cpu_count() and m >= 0.85 * os.cpu_count():
        return "No single process saturated, but the machine's cores were busy: bound by the shared CPUs."
    return "No process saturated: bound by round-trip latency and concurrency."


def _mid(trials: Sequence[dict[str, float]] | None) -> dict[str, float]:
    """The per-reason counts of the trial with the median total."""
    if not trials:
        return {}
    return sorted(trials, key=lambda t: sum(t.values()))[len(trials) // 2]


def explain(rows: Sequence[Row]) -> list[str]:
    out: list[str] = []
    for r in rows:
        x: dict[str, Any] = r.extra
        if r.figure == "1" and "cpu_us_per_decision" in x:
            per = x["cpu_us_per_decision"]
            agent, redis = _med(per, "agent"), _med(per, "redis")
            ceil = median(x["ceiling_redis_cpu_us_per_call"]) if x.get("ceiling_redis_cpu_us_per_call") else None
            busy = _who_busy(x["cpu_utilisation"])
            out.append(
                f"Figure 1: {_cores(x['cpu_utilisation'])} during the load; per decision the agent spends "
                f"{agent:.1f} us of Python CPU and Redis {redis:.1f} us (redis-benchmark's token-bucket call: "
                f"{ceil:.1f} us of Redis CPU). "
                + (f"Bound by {' and '.join(busy)} CPU (near one core on 2 shared cores)." if busy else
                   _unsaturated(x["cpu_utilisation"]))
                + f" {100 * median(x['allowed_share']):.0f}% of the mix was admitted"
                + (f", {100 * median(x['fallback_share']):.1f}% decided by the local fallback (store degraded)"
                   if x.get("fallback_share") else "") + ".")
        elif r.figure == "2" and "throughput" in r.name and "cpu_us_per_request" in x:
            per = x["cpu_us_per_request"]
            ceiling = "raw" if "raw" in per else "echo"
            a, e = _med(per["agent"], "server"), _med(per[ceiling], "server")
            lit = f", the Litestar echo {_med(per['echo'], 'server'):.0f} us" if ceiling == "raw" else ""
            redis = _med(per["agent"], "redis")
            out.append(
                f"Figure 2: per request the agent process spends {a:.0f} us of CPU, the {ceiling} echo app {e:.0f} us"
                f"{lit} (Redis {redis:.1f} us per request for the agent); agent {_cores(x['cpu_utilisation']['agent'])}, "
                f"{ceiling} echo {_cores(x['cpu_utilisation'][ceiling])}. With {x.get('workers', 1)} worker(s) each, throughput "
                f"is about cores / CPU per request, so the ratio is bound by the agent's extra Python work per request "
                f"({a - e:.0f} us: plan, keys, metrics, decision record, batcher) — see profile-agent-http.txt."
                + (f" {100 * median(x['agent_fallback_share']):.1f}% of the agent's answers were local fallback "
                   f"decisions; degraded decisions by reason in the median trial: "
                   f"{_mid(x.get('agent_degraded_by_reason'))}." if x.get("agent_fallback_share") else ""))
        elif r.figure == "3" and "moving window" in r.name:
            share = x.get("engine_allowed_share")
            out.append(
                "Figure 3: engine and limits run in this one benchmark process (one core at most for either); "
                f"the engine admitted {100 * median(share):.0f}% (same rule, 20 per 10 s per user, 10k users). "
                "The engine's Python CPU per decision (plan, HMAC keys, metrics, decision record) is the bound: "
                "see profile-engine.txt.")
        elif r.figure == "4" and "cpu_us_per_grant" in x:
            per = x["cpu_us_per_grant"]
            cas = median(x["ceiling_etcd_cpu_us_per_cas"]) if x.get("ceiling_etcd_cpu_us_per_cas") else None
            busy = _who_busy(x["cpu_utilisation"])
            out.append(
                f"Figure 4: {_cores(x['cpu_utilisation'])}; per grant the allocator spends "
                f"{_med(per, 'allocator'):.0f} us and etcd {_med(per, 'etcd'):.0f} us of CPU (etcd per single "
                f"CAS: {cas:.0f} us)"
                + (f", {median(x['grants_per_txn']):.0f} grants per etcd transaction. " if x.get("grants_per_txn") else ". ")
                + (f"Bound by {' and '.join(busy)} CPU." if busy else _unsaturated(x["cpu_utilisation"])))
        elif r.figure == "5":
            out.append(f"Figure 5: {x.get('redis_calls')} script calls for {x.get('attempts')} attempts "
                       f"({x.get('admitted')} admitted as the bucket refilled).")
        elif r.figure == "6" and "utilisation" in r.name:
            out.append(f"Figure 6, {r.name.split(':')[0]}: admitted per window {x.get('admitted_per_window')} "
                       f"against demand offered {x.get('offered_per_window')} (G={x.get('G')}, bound "
                       f"{x.get('bound')}); over the {x.get('judged_windows')} windows with demand above G, "
                       f"min {x.get('min', 0):.3f}, max {x.get('max', 0):.3f} of G (each answer in the window of "
                       f"its round trip's midpoint); judged with the answers that straddle a boundary in either "
                       f"window, as the chaos checker judges: min {x.get('min_at_most', 0):.3f}.")
    grants = [r for r in rows if r.figure == "7" and "single grant" in r.name]
    if len(grants) >= 2:
        a, b = grants[0], grants[-1]
        out.append(f"Figure 7: single-grant p50 goes from {a.value:.2f} ms ({a.name.split(':')[0]}) to "
                   f"{b.value:.2f} ms ({b.name.split(':')[0]}), x{b.value / a.value:.1f}; p99 "
                   f"{a.extra.get('p99_ms', 0):.2f} -> {b.extra.get('p99_ms', 0):.2f} ms.")
    mem = [r for r in rows if r.figure == "7" and "memory per key" in r.name]
    if len(mem) >= 2:
        out.append("Figure 7: Redis bytes per active key " + " -> ".join(f"{r.value:.0f}" for r in mem)
                   + " as keys grow 10x per step (fixed overhead amortised; per-key cost flat).")
    return out
