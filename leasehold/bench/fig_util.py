"""Figure 6: utilisation of a global pool G across two regions with demand above G in both:
admitted / G per window, and admissions beyond the bound G + the regions' fallback allowances."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernel.bundle import Bundle, Pool, Rule, seal, validate_bundle
from leasehold.topology import LocalTopology, TopologySpec

from .context import Ctx
from .fig_alloc import write_bundle
from .harness import loadgen
from .stats import Goal, Row

G = 200
FALLBACK = 10
REGIONS = ("eu", "us")
DEMAND = 1.5  # each region asks for this many times G per window


def util_bundle(window_ms: int) -> Bundle:
    pool = Pool(id="util", window_ms=window_ms, limit=G, lease_ttl_ms=min(1_000, window_ms), chunk_min=5,
                chunk_max=50, fallback_per_region=FALLBACK, prefetch_ms=min(500, window_ms // 4),
                active_horizon_ms=window_ms)
    rule = Rule(id="tenant-t0-util", scope="tenant", tenant="t0", algorithm="pool", pool="util", cost=1,
                fail_mode="local_bounded")
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[rule],
                         pools=[pool]))
    validate_bundle(bundle)
    return bundle


def per_window(reports: list[dict], start_wall: float, end_wall: float, window_ms: int) -> dict[int, int]:
    """Admissions per window index, only windows wholly inside [start_wall, end_wall]."""
    first = int(start_wall * 1000 // window_ms) + 1
    last = int(end_wall * 1000 // window_ms) - 1
    out = {k: 0 for k in range(first, last + 1)}
    for rep in reports:
        for k, n in rep["allowed_by_window"].items():
            if int(k) in out:
                out[int(k)] += n
    return out


def run(ctx: Ctx) -> list[Row]:
    w = ctx.util_window_ms
    policy = write_bundle(ctx.work / "fig6-policy.json", util_bundle(w))
    topo = LocalTopology(TopologySpec(run_dir=Path(ctx.work / "fig6-topology"), policy=policy, regions=REGIONS,
                                 allocators=1)).start()
    try:
        # + 2 windows so that ctx.util_windows whole windows lie inside the run
        duration = (ctx.util_windows + 2) * w / 1000
        rate = DEMAND * G / (w / 1000)
        cfgs = [{"port": int(topo.agent_urls[r][0].rsplit(":", 1)[1]), "path": "/v1/admit",
                 "workload": "tenant_admit", "workload_args": {"tenants": 1, "tag": f"u{r}"}, "conns": 8,
                 "rate": rate, "duration_s": duration, "window_ms": w, "max_requests": int(rate * duration) + 10}
                for r in REGIONS]
        with ThreadPoolExecutor(len(cfgs)) as ex:
            reports = list(ex.map(loadgen, cfgs))
        start = max(rep["start_wall"] for rep in reports)
        end = min(rep["end_wall"] for rep in reports)
    finally:
        topo.stop()
    for r, rep in zip(REGIONS, reports, strict=True):
        if rep["non200"] or rep["errors"]:
            ctx.note(f"fig6 {r}: {rep['non200']} non-200, {rep['error_samples']}")
    windows = per_window(reports, start, end, w)
    bound = G + FALLBACK * len(REGIONS)
    util = [n / G for n in windows.values()]
    beyond = sum(max(0, n - bound) for n in windows.values())
    extra = {"G": G, "bound": bound, "window_ms": w, "admitted_per_window": list(windows.values()),
             "demand_per_region_per_window": DEMAND * G}
    if not util:
        ctx.note("fig6: no whole window inside the run")
        util = [float("nan")]
    return [
        Row("6", f"utilisation, 2 regions, {len(windows)} windows of {w} ms, G={G}: mean admitted/G",
            sum(util) / len(util), "of G", goal=Goal(">=", 0.97), extra={**extra, "min": min(util), "max": max(util)}),
        Row("6", f"admissions beyond G + fallback allowances ({bound}/window)", beyond, "admissions",
            goal=Goal("<=", 0), extra=extra),
    ]
