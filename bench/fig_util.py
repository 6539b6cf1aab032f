"""Figure 6: no capacity wasted when nothing fails. Two regions with two agents each (sharing the
region's Redis and its pool balances) and one allocator; two pools of G per window, each asked
for more than G in every window from both regions:

* ``util``, a tenant-scoped pool (tenant ``t0``): every decision spends the region's leased balance;
* ``util-g``, a global-scope pool (route ``search`` of every tenant): every agent spends it from
  in-process chunks bought from the region's ``{g:util-g}`` balance.

Per pool and window: admitted, and the demand *offered to the pool* — answers the pool's rule gave
(admitted or denied) to attempts really made, counted by the load generator — whatever rate it
meant to send (on a loaded machine it sends less). Every window with demand above G must reach
0.97 of G: :func:`chaos.invariants.fault_free_utilisation`, the chaos checker's own check. And no
window may admit beyond the bound G + the regions' fallback allowances."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chaos.invariants import UTILISATION_FLOOR, Utilisation, fault_free_utilisation
from kernel.bundle import Bundle, Pool, make_rule, seal, validate_bundle
from leasehold.local.topology import LocalTopology, TopologySpec

from .context import Ctx
from .fig_alloc import write_bundle
from .harness import loadgen
from .stats import Goal, Row

G = 200
FALLBACK = 10
REGIONS = ("eu", "us")
AGENTS = 2  # per region
DEMAND = 1.5  # each region asks each pool for this many times G per window
TENANT_RULE, GLOBAL_RULE = "tenant-t0-util", "global-search-util"


def util_bundle(window_ms: int) -> Bundle:
    tenant = Pool(id="util", window_ms=window_ms, limit=G, lease_ttl_ms=min(1_000, window_ms), chunk_min=5,
                  chunk_max=50, fallback_per_region=FALLBACK, prefetch_ms=min(500, window_ms // 4),
                  active_horizon_ms=window_ms)
    fleet = Pool(id="util-g", window_ms=window_ms, limit=G, lease_ttl_ms=min(1_000, window_ms), chunk_min=5,
                 chunk_max=50, fallback_per_region=FALLBACK, prefetch_ms=min(500, window_ms // 4),
                 active_horizon_ms=window_ms, chunk_validity_ms=250)
    rules = [make_rule(id=TENANT_RULE, scope="tenant", tenant="t0", algorithm="pool", pool="util", cost=1,
                       fail_mode="local_bounded"),
             make_rule(id=GLOBAL_RULE, scope="global", route_group="search", algorithm="pool", pool="util-g",
                       cost=1, fail_mode="local_bounded")]
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=rules,
                         pools=[tenant, fleet]))
    validate_bundle(bundle)
    return bundle


def per_window(reports: list[dict], start_wall: float, end_wall: float, window_ms: int,
               key: str = "allowed_by_window") -> dict[int, int]:
    """Counts per window index (``key`` of the load reports), only windows wholly inside
    [start_wall, end_wall]."""
    first = int(start_wall * 1000 // window_ms) + 1
    last = int(end_wall * 1000 // window_ms) - 1
    out = {k: 0 for k in range(first, last + 1)}
    for rep in reports:
        for k, n in rep.get(key, {}).items():
            if int(k) in out:
                out[int(k)] += n
    return out


def pool_rows(label: str, pool: str, reports: list[dict], start: float, end: float, w: int) -> list[Row]:
    admitted = per_window(reports, start, end, w)
    most = per_window(reports, start, end, w, key="allowed_max_by_window")
    offered = per_window(reports, start, end, w, key="offered_by_window")
    # judged as the chaos checker judges: an answer whose round trip straddles a boundary may lie in
    # either window (a request sent just before it waits for the next window's lease)
    util = [Utilisation(pool, k, admitted[k], max(offered[k], admitted[k]), G, admitted_max=most[k]) for k in admitted]
    judged = [u for u in util if u.judged]
    short = fault_free_utilisation(util)  # the chaos checker's check, as is
    bound = G + FALLBACK * len(REGIONS)
    beyond = sum(max(0, n - bound) for n in admitted.values())
    extra = {"G": G, "bound": bound, "window_ms": w, "admitted_per_window": list(admitted.values()),
             "offered_per_window": [offered[k] for k in admitted], "judged_windows": len(judged),
             "min": min((u.ratio for u in judged), default=float("nan")),
             "max": max((u.ratio for u in judged), default=float("nan")),
             "min_at_most": min((u.ratio_max for u in judged), default=float("nan")),
             "shortfalls": [v.detail for v in short], "demand_meant_per_region_per_window": DEMAND * G}
    # no window with demand above G (a load generator that could not keep up): nothing was shown
    flagged = float(len(short)) if judged else math.nan
    return [
        Row("6", f"{label}: windows below {UTILISATION_FLOOR} x G of the {len(judged)} with demand > G "
            f"({len(REGIONS)} regions x {AGENTS} agents, G={G} per {w} ms): utilisation", flagged, "windows",
            goal=Goal("<=", 0), extra=extra),
        Row("6", f"{label}: admissions beyond G + fallback allowances ({bound}/window)", beyond, "admissions",
            goal=Goal("<=", 0), extra=extra),
    ]


def run(ctx: Ctx) -> list[Row]:
    w = ctx.util_window_ms
    policy = write_bundle(ctx.work / "fig6-policy.json", util_bundle(w))
    topo = LocalTopology(TopologySpec(run_dir=Path(ctx.work / "fig6-topology"), policy=policy, regions=REGIONS,
                                      agents_per_region=AGENTS, allocators=1)).start()
    try:
        # + 2 windows so that ctx.util_windows whole windows lie inside the run
        duration = (ctx.util_windows + 2) * w / 1000
        rate = DEMAND * G / (w / 1000)
        loads = {"util": ("tenant_admit", {"tenants": 1}, TENANT_RULE),
                 "util-g": ("global_admit", {"tenants": 10}, GLOBAL_RULE)}
        cfgs = [{"ports": [int(u.rsplit(":", 1)[1]) for u in topo.agent_urls[r]], "path": "/v1/admit",
                 "workload": workload, "workload_args": {**args, "tag": f"{pool}-{r}"}, "conns": 8, "rate": rate,
                 "duration_s": duration, "window_ms": w, "max_requests": int(rate * duration) + 10,
                 "offered_marker": f'"policyId":"{rule}"', "pool": pool, "region": r}
                for pool, (workload, args, rule) in loads.items() for r in REGIONS]
        with ThreadPoolExecutor(len(cfgs)) as ex:
            reports = list(ex.map(loadgen, cfgs))
        start = max(rep["start_wall"] for rep in reports)
        end = min(rep["end_wall"] for rep in reports)
    finally:
        topo.stop()
    for cfg, rep in zip(cfgs, reports, strict=True):
        if rep["non200"] or rep["errors"]:
            ctx.note(f"fig6 {cfg['pool']} {cfg['region']}: {rep['non200']} non-200, {rep['error_samples']}")
    rows = []
    for label, pool in (("tenant-scoped pool", "util"), ("global-scope pool (in-process chunks)", "util-g")):
        mine = [rep for cfg, rep in zip(cfgs, reports, strict=True) if cfg["pool"] == pool]
        got = pool_rows(label, pool, mine, start, end, w)
        if not got[0].extra["judged_windows"]:
            ctx.note(f"fig6 {pool}: no whole window with demand above G (the load generator sent less than meant)")
        rows += got
    return rows
