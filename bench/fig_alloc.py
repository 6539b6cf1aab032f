"""Figure 4: lease grants/s through ``POST /v1/leases/batch`` vs single compare-and-swap
transactions/s (aetcd, distinct keys) on the same etcd; and figure 7's allocator half: etcd key
count and single-grant latency as the number of pools grows."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import aetcd

from kernel.bundle import Bundle, Pool, encode_bundle, seal, validate_bundle
from leasehold.local.procs import EtcdCluster

from .context import Ctx
from .harness import CpuMeter, drive, loadgen, services, start_allocator
from .stats import Goal, Row, median
from .workloads import pool_id

BATCH = 64
CONNS = 4
CAS_CONCURRENCY = CONNS * BATCH  # as many CAS in flight as lease requests in flight
_TXN_GRANTS = re.compile(r"^leasehold_allocator_grants_per_txn_(sum|count) (\S+)$", re.M)


def txn_grants(port: int) -> tuple[float, float]:
    """The allocator's (grants, transactions) committed so far, from its ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        found = dict(_TXN_GRANTS.findall(r.read().decode()))
    return float(found.get("sum", 0)), float(found.get("count", 0))


def many_pools_bundle(n: int, *, limit: int = 1_000_000_000, window_ms: int = 60_000) -> Bundle:
    """A sealed bundle of ``n`` large pools (one per tenant) and no rules: allocator load only."""
    pools = [Pool(id=pool_id(i), window_ms=window_ms, limit=limit, lease_ttl_ms=15_000, chunk_min=1,
                  chunk_max=1_000_000, fallback_per_region=0, prefetch_ms=2_000) for i in range(n)]
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[], pools=pools))
    validate_bundle(bundle)
    return bundle


def write_bundle(path: Path, bundle: Bundle) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_bundle(bundle))
    return path


def _client(etcd: EtcdCluster) -> aetcd.Client:
    host, port = etcd.endpoints[0].rsplit(":", 1)
    return aetcd.Client(host, int(port), timeout=5)


async def cas_rate(etcd: EtcdCluster, tag: str, duration_s: float,
                   concurrency: int = CAS_CONCURRENCY) -> tuple[float, float]:
    """Single-key compare-and-swap transactions/s: create each distinct key iff its version is 0."""
    async with _client(etcd) as c:
        t = c.transactions

        async def one(i: int) -> None:
            key = f"/bench/cas/{tag}/{i:09d}".encode()
            ok, _ = await c.transaction(compare=[t.version(key) == 0], success=[t.put(key, b"1")], failure=[])
            if not ok:
                raise RuntimeError(f"CAS on a fresh key failed: {key!r}")

        done, secs = await drive(one, concurrency=concurrency, duration_s=duration_s, max_ops=5_000_000)
    return done / secs, secs


async def etcd_keys(etcd: EtcdCluster, prefix: bytes = b"/leasehold/") -> int:
    async with _client(etcd) as c:
        res = await c.get_prefix(prefix, keys_only=True)
        return len(res)


def run(ctx: Ctx) -> list[Row]:
    import uvloop

    etcd = EtcdCluster(ctx.work / "fig4-etcd", members=1).start()
    with services(etcd):
        policy = write_bundle(ctx.work / "fig4-policy.json", many_pools_bundle(1_000))
        alloc = start_allocator(ctx.work / "fig4-allocator", etcd, policy)
        with services(alloc):
            grants, cas, cpu, cpu_us, util, cas_cpu_us, per_txn = [], [], [], [], [], [], []
            for t in range(ctx.trials):
                before = txn_grants(alloc.port)
                with CpuMeter({"allocator": alloc.proc.pid, "etcd": etcd.procs[0].pid}) as meter:
                    res = loadgen({"port": alloc.port, "path": "/v1/leases/batch", "workload": "lease_batch",
                                   "workload_args": {"pools": 1_000, "size": BATCH, "tag": f"f4t{t}"},
                                   "items_per_request": BATCH, "conns": CONNS, "duration_s": ctx.duration_s,
                                   "warmup_s": ctx.warmup_s, "max_requests": 1_000_000, "count": '"granted":'})
                cpu_us.append(meter.per(res["sent"] * BATCH))
                after = txn_grants(alloc.port)
                per_txn.append((after[0] - before[0]) / max(1.0, after[1] - before[1]))
                util.append(meter.utilisation())
                if res["non200"] or res["errors"] or res["counted"] != res["ok"] * BATCH:
                    ctx.note(f"fig4 trial {t}: {res['non200']} non-200, {res['errors']} errors, "
                             f"{res['ok'] * BATCH - res['counted']} batch items without a grant")
                grants.append(res["counted_per_s"])
                cpu.append(res["cpu_pct"])
                with CpuMeter({"etcd": etcd.procs[0].pid}) as cm:
                    rate, secs = uvloop.run(cas_rate(etcd, f"t{t}", ctx.duration_s))
                cas.append(rate)
                cas_cpu_us.append(cm.per(rate * secs)["etcd"])
    return [Row("4", f"lease grants via /v1/leases/batch ({BATCH}/batch)", median(grants), "grants/s",
                median(cas), "single CAS txn/s (aetcd, distinct keys)", Goal(">=", 4.0),
                extra={"trials": grants, "ceiling_trials": cas, "loadgen_cpu_pct": cpu,
                       "cpu_us_per_grant": cpu_us, "cpu_utilisation": util, "ceiling_etcd_cpu_us_per_cas": cas_cpu_us,
                       "grants_per_txn": per_txn})]


def run_scale(ctx: Ctx) -> list[Row]:
    """Figure 7 (allocator): etcd keys and single-grant latency after one grant per pool."""
    import uvloop

    rows: list[Row] = []
    for n in ctx.scale_pools:
        etcd = EtcdCluster(ctx.work / f"fig7-etcd-{n}", members=1).start()
        with services(etcd):
            policy = write_bundle(ctx.work / f"fig7-policy-{n}.json", many_pools_bundle(n))
            alloc = start_allocator(ctx.work / f"fig7-allocator-{n}", etcd, policy)
            with services(alloc):
                size = min(512, n)
                batches = -(-n // size)
                fill = loadgen({"port": alloc.port, "path": "/v1/leases/batch", "workload": "lease_batch",
                                "workload_args": {"pools": n, "size": size, "tag": f"f7n{n}"},
                                "items_per_request": size, "conns": 1, "duration_s": 120,
                                "max_requests": batches, "count": '"granted":'}, timeout=300)
                keys = uvloop.run(etcd_keys(etcd))
                lat = loadgen({"port": alloc.port, "path": "/v1/leases", "workload": "lease_single",
                               "workload_args": {"pools": n, "tag": f"f7s{n}"}, "conns": 1,
                               "duration_s": ctx.duration_s, "max_requests": 2_000})
        rows.append(Row("7", f"allocator, {n:,} pools: etcd keys after one grant per pool", keys, "keys",
                        extra={"granted": fill["counted"], "fill_s": fill["elapsed_s"], "keys_per_pool": keys / n}))
        rows.append(Row("7", f"allocator, {n:,} pools: single grant p50 / p99", lat["p50_ms"], "ms p50",
                        extra={"p99_ms": lat["p99_ms"], "grants_per_s_1conn": lat["rps"]}))
        rows[-1].name += f" (p99 {lat['p99_ms']:.2f} ms)"
    return rows
