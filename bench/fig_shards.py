"""Figure "shards" (``--only shards``): the allocator sharded over 1, 2 and 3 replicas on the same
etcd (``--shards 64``).

For each replica count: every replica leads the shards rendezvous hashing gives it; one load
generator per replica sends ``POST /v1/leases/batch`` (64 grants per batch, 4 connections)
over the pools its replica leads (1,000 pools in all). Measured: total grants/s, CPU per grant
of each replica, etcd CPU per grant, grants per etcd transaction; projected capacity =
``min(replicas x one core / CPU per grant, etcd's ceiling)`` with etcd's ceiling at one core
(``1e6 / etcd CPU per grant``). The usage report that follows every lease is measured once
(one replica, reports of expired leases, one per request and in batches as the agents send
them): the per-lease cost of ``docs/capacity.md`` is a grant plus its report.

On a 2-core machine shared by the replicas, etcd and the load generators the total cannot
scale linearly: the projection is from CPU per grant, the measured total is reported as is.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from allocator.shards import assignment
from kernel.bundle import Bundle, Pool, seal, validate_bundle
from kernel.shards import shard_of
from leasehold.local.procs import EtcdCluster

from .capacity import projected_capacity
from .context import Ctx
from .fig_alloc import many_pools_bundle, write_bundle
from .harness import CpuMeter, Service, loadgen, services, start_allocator
from .stats import Row, median, percentile
from .workloads import pool_id

SHARDS = 64
POOLS = 1_000
BATCH = 64
CONNS = 4  # per replica
REPLICAS = (1, 2, 3)
REPORT_TTL_MS = 1_000  # lease TTL of the usage-report phase's pools: reports are accepted after expiry


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _txn_counts(allocs: list[Service]) -> tuple[float, float]:
    """(grants, transactions) committed so far by these replicas (their grants-per-txn histograms)."""
    grants = txns = 0.0
    with httpx.Client(timeout=5) as c:
        for a in allocs:
            text = c.get(a.url + "/metrics").text
            grants += _metric(text, "leasehold_allocator_grants_per_txn_sum")
            txns += _metric(text, "leasehold_allocator_grants_per_txn_count")
    return grants, txns


def _converge(allocs: list[Service], nodes: list[str], timeout_s: float = 60.0) -> dict[int, str]:
    want = assignment(SHARDS, set(nodes))
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as c:
        while time.monotonic() < deadline:
            try:
                maps = [c.get(a.url + "/v1/shards").json() for a in allocs]
                if all([sl["nodeId"] for sl in m["leaders"]] == [want[s] for s in range(SHARDS)] for m in maps):
                    return want
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{len(allocs)} replicas did not converge on the shard assignment")


def _one_count(ctx: Ctx, etcd: EtcdCluster, policy: Path, n: int, shards: int = SHARDS) -> dict:
    """``n`` replicas with ``shards`` shards (1: today's unsharded allocator, one replica)."""
    nodes = [f"s{shards}n{n}r{i}" for i in range(n)]
    prefix = f"/bench-shards-{shards}-{n}/"
    allocs = [start_allocator(ctx.work / f"fig8-{shards}-{n}-{node}", etcd, policy, node=node, lead=shards == 1,
                              settings={"shards": shards, "prefix": prefix, "election_ttl_s": 3})
              for node in nodes]
    with services(*allocs):
        want = _converge(allocs, nodes) if shards > 1 else {s: nodes[0] for s in range(SHARDS)}
        pools_of = {node: [pool_id(i) for i in range(POOLS) if want[shard_of(pool_id(i), SHARDS)] == node]
                    for node in nodes}
        trials = []
        for t in range(ctx.trials):
            cfgs = [{"port": a.port, "path": "/v1/leases/batch", "workload": "lease_batch_of",
                     "workload_args": {"pool_ids": pools_of[node], "size": BATCH, "tag": f"f8n{n}t{t}{node}"},
                     "items_per_request": BATCH, "conns": CONNS, "duration_s": ctx.duration_s,
                     "warmup_s": ctx.warmup_s, "max_requests": 1_000_000, "count": '"granted":'}
                    for a, node in zip(allocs, nodes, strict=True)]
            g0, x0 = _txn_counts(allocs)
            pids = {node: a.proc.pid for a, node in zip(allocs, nodes, strict=True)} | {"etcd": etcd.procs[0].pid}
            with CpuMeter(pids) as meter, ThreadPoolExecutor(len(cfgs)) as pool:
                results = list(pool.map(loadgen, cfgs))
            g1, x1 = _txn_counts(allocs)
            sent = {node: r["sent"] * BATCH for node, r in zip(nodes, results, strict=True)}
            total = sum(sent.values())
            bad = sum(r["non200"] + r["errors"] for r in results)
            if bad or any(r["counted"] != r["ok"] * BATCH for r in results):
                ctx.note(f"fig8 {n} replica(s) trial {t}: {bad} failed requests or batch items without a grant")
            trials.append({
                "grants_per_s": sum(r["counted_per_s"] for r in results),
                "per_replica_grants_per_s": {node: r["counted_per_s"] for node, r in zip(nodes, results, strict=True)},
                "replica_cpu_us_per_grant": {node: 1e6 * meter.cpu[node] / sent[node] for node in nodes if sent[node]},
                "etcd_cpu_us_per_grant": 1e6 * meter.cpu["etcd"] / total if total else float("nan"),
                "grants_per_txn": (g1 - g0) / (x1 - x0) if x1 > x0 else float("nan"),
                "txn_per_s": (x1 - x0) / meter.wall,
                "utilisation": meter.utilisation(),
                "loadgen_cpu_pct": sum(r["cpu_pct"] for r in results),
            })
    return {"replicas": n, "shards": shards, "shards_per_replica": {node: len([s for s in want.values() if s == node]) for node in nodes},
            "pools_per_replica": {node: len(p) for node, p in pools_of.items()}, "trials": trials}


def _report_bundle() -> Bundle:
    pools = [Pool(id=pool_id(i), window_ms=600_000, limit=1_000_000_000, lease_ttl_ms=REPORT_TTL_MS, chunk_min=1,
                  chunk_max=1_000_000, fallback_per_region=0, prefetch_ms=2_000) for i in range(POOLS)]
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[], pools=pools))
    validate_bundle(bundle)
    return bundle


async def _post_reports(url: str, reports: list[dict], concurrency: int = 16, batch: int = 0,
                        ) -> tuple[int, int, list[float]]:
    """Every report once (bounded by the list): one per request, or ``batch`` per
    ``POST /v1/usage/batch``; (reports accepted, reports failed, request latencies in s)."""
    items = [reports[i:i + batch] for i in range(0, len(reports), batch)] if batch else [[r] for r in reports]
    it = iter(items)
    counts = {"ok": 0, "bad": 0}
    lat: list[float] = []

    async def worker(c: httpx.AsyncClient) -> None:
        for reps in it:
            t0 = time.perf_counter()
            try:
                if batch:
                    r = await c.post(f"{url}/v1/usage/batch", json={"reports": reps})
                    good = sum(1 for x in r.json()["results"] if "granted" in x) if r.status_code == 200 else 0
                else:
                    r = await c.post(f"{url}/v1/leases/{reps[0]['leaseId']}/usage", json=reps[0])
                    good = int(r.status_code == 200)
                counts["ok"] += good
                counts["bad"] += len(reps) - good
            except (httpx.HTTPError, ValueError, KeyError):
                counts["bad"] += len(reps)
            lat.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return counts["ok"], counts["bad"], lat


def _report_cost(ctx: Ctx, etcd: EtcdCluster) -> list[dict]:
    """One sharded replica: grant leases, let them expire, then measure the CPU of their usage
    reports — half sent one per request (16 in flight; the committer groups whatever is queued),
    half as ``POST /v1/usage/batch`` of 64 (4 in flight, as the agents send them)."""
    policy = write_bundle(ctx.work / "fig8-report-policy.json", _report_bundle())
    alloc = start_allocator(ctx.work / "fig8-report", etcd, policy, node="rep1", lead=False,
                            settings={"shards": SHARDS, "prefix": "/bench-reports/"})
    out = []
    with services(alloc):
        _converge([alloc], ["rep1"])
        batches = 40 if ctx.quick else 160
        loadgen({"port": alloc.port, "path": "/v1/leases/batch", "workload": "lease_batch",
                 "workload_args": {"pools": POOLS, "size": BATCH, "tag": "f8r", "want": 2},
                 "items_per_request": BATCH, "conns": 2, "duration_s": 60, "max_requests": batches})
        reports = [{"leaseId": f"f8r-{i:08d}-{j:04d}", "region": "bench", "pool": pool_id((i * BATCH + j) % POOLS),
                    "spent": 1} for i in range(batches) for j in range(BATCH)]
        time.sleep(REPORT_TTL_MS / 1000 + 0.5)  # usage is accepted only after the lease expired
        half = len(reports) // 4  # singles are slower: a quarter of the reports
        for mode, part, conc, size in (("single", reports[:half], 16, 0), ("batch", reports[half:], 4, BATCH)):
            with CpuMeter({"replica": alloc.proc.pid, "etcd": etcd.procs[0].pid}) as meter:
                ok, bad, lat = asyncio.run(_post_reports(alloc.url, part, concurrency=conc, batch=size))
            if bad:
                ctx.note(f"fig8 usage reports ({mode}): {bad} of {ok + bad} not accepted")
            out.append({"mode": mode, "reports": ok, "reports_per_s": ok / meter.wall,
                        "replica_cpu_us_per_report": meter.per(ok)["replica"],
                        "etcd_cpu_us_per_report": meter.per(ok)["etcd"], "utilisation": meter.utilisation(),
                        "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99),
                        "max_ms": 1000 * max(lat)})
    return out


def run(ctx: Ctx) -> list[Row]:
    etcd = EtcdCluster(ctx.work / "fig8-etcd", members=1).start()
    rows: list[Row] = []
    with services(etcd):
        policy = write_bundle(ctx.work / "fig8-policy.json", many_pools_bundle(POOLS))
        counts = [_one_count(ctx, etcd, policy, 1, shards=1)] + [_one_count(ctx, etcd, policy, n) for n in REPLICAS]
        reports = _report_cost(ctx, etcd)
    base = None
    for c in counts:
        n, trials, sharded = c["replicas"], c["trials"], c["shards"] > 1
        total = median([t["grants_per_s"] for t in trials])
        rep_us = median([median(list(t["replica_cpu_us_per_grant"].values())) for t in trials])
        etcd_us = median([t["etcd_cpu_us_per_grant"] for t in trials])
        proj = projected_capacity(n, rep_us, etcd_us)
        if sharded:
            base = base or total
        label = f"sharded allocator, {n} replica(s) x 64 shards" if sharded else "unsharded allocator (--shards 1)"
        rows.append(Row("shards", f"{label}: total grants/s (same etcd)", total, "grants/s", extra={
                            "replica_cpu_us_per_grant": rep_us, "etcd_cpu_us_per_grant": etcd_us,
                            "grants_per_txn": median([t["grants_per_txn"] for t in trials]),
                            "etcd_txn_per_s": median([t["txn_per_s"] for t in trials]),
                            "projected_grants_per_s": proj.per_s, "projection_bound_by": proj.bound_by,
                            "projection_replicas": proj.replica_bound, "projection_etcd_one_core": proj.etcd_bound,
                            "speedup_vs_1": total / base if base and sharded else None, **c}))
        rows[-1].name += (f" — CPU/grant {rep_us:.0f} us per replica, etcd {etcd_us:.0f} us; projected "
                          f"{proj.per_s:,.0f}/s ({proj.bound_by}-bound)")
    one = rows[1].extra  # one sharded replica
    for report in reports:
        lease = {"replica": one["replica_cpu_us_per_grant"] + report["replica_cpu_us_per_report"],
                 "etcd": one["etcd_cpu_us_per_grant"] + report["etcd_cpu_us_per_report"]}
        how = "one per request, 16 in flight" if report["mode"] == "single" else f"{BATCH} per batch, 4 in flight"
        rows.append(Row("shards", f"usage reports ({how}; grouped into transactions): replica "
                                  f"{report['replica_cpu_us_per_report']:.0f} us, etcd "
                                  f"{report['etcd_cpu_us_per_report']:.0f} us CPU per report",
                        report["reports_per_s"], "reports/s", extra={**report, "lease_cost_us": lease}))
    return rows
