"""The allocator's cost per grant in process: figure 4's batches (64 grants, 1,000 pools, 4 callers)
through the allocator's ASGI app — the batch fast path, the writer, the committer and etcd
transactions against a real etcd member — without uvicorn and without a load generator sharing
the process. Prints the process CPU (every thread: gRPC's too) per grant of the measured batches,
and etcd's side of them: its CPU per grant and, from its ``/metrics`` before and after, the
requests it served (by gRPC method), the keys it put and read (a compare reads one) and the bytes
it received, per grant — counts that do not depend on the machine's load.

    python -m bench.grant_cost [--batches 400] [--warmup 40] [--rounds 1]

Under ``valgrind --tool=cachegrind --cache-sim=no`` the instructions of two runs with different
``--batches`` give the instructions per grant by difference (imports and start-up cancel out).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from .fig_alloc import BATCH, CONNS, many_pools_bundle, write_bundle
from .workloads import lease_batch

POOLS = 1_000
# etcd's counters read before and after the measured batches (etcd 3.4/3.5 names)
_ETCD_COUNTERS = re.compile(r'^(grpc_server_handled_total\{[^}]*grpc_method="(\w+)"[^}]*\}|etcd_mvcc_(put|range|txn)_total|'
                            r'etcd_network_client_grpc_received_bytes_total) (\S+)$')


def etcd_counters(url: str) -> dict[str, float]:
    """etcd's request counters (``rpc <method>``, ``put``/``range``/``txn`` as its MVCC store
    counts them, ``bytes received``) from its ``/metrics``."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            m = _ETCD_COUNTERS.match(line)
            if m:
                name = f"rpc {m[2]}" if m[2] else (m[3] or "bytes received")
                out[name] = out.get(name, 0.0) + float(m[4])
    return out


async def _post(app: Any, body: bytes) -> bytes:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    out: list[bytes] = []
    status: list[int] = []

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status.append(msg["status"])
        elif msg["type"] == "http.response.body":
            out.append(msg.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/leases/batch", "raw_path": b"/v1/leases/batch", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"allocator"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"batch answered {status}: {b''.join(out)[:300]!r}")
    return b"".join(out)


async def _drive(app: Any, bodies: list[bytes]) -> int:
    """``bodies`` posted by CONNS callers, one batch each at a time; grants counted."""
    it = iter(bodies)
    granted = 0

    async def caller() -> None:
        nonlocal granted
        for body in it:
            answer = await _post(app, body)
            granted += answer.count(b'"granted":')

    await asyncio.gather(*(caller() for _ in range(CONNS)))
    return granted


@asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    """The app's lifespan run in this event loop (the writer's futures are this loop's)."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    started, finished = asyncio.Event(), asyncio.Event()

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"].startswith("lifespan.startup"):
            started.set()
        elif msg["type"].startswith("lifespan.shutdown"):
            finished.set()

    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send))
    await inbox.put({"type": "lifespan.startup"})
    await asyncio.wait_for(started.wait(), 30)
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(finished.wait(), 30)
        await task


Measured = tuple[int, float, float, float, dict[str, float]]  # grants, CPU s, wall s, etcd CPU s, etcd counts


async def measure(work: Path, batches: int, warmup: int, rounds: int) -> list[Measured]:
    from allocator.app import create_app
    from allocator.settings import AllocatorSettings
    from leasehold.local.procs import EtcdCluster

    from .harness import proc_cpu, services

    etcd = EtcdCluster(work / "etcd", members=1).start()
    out = []
    with services(etcd):
        policy = write_bundle(work / "policy.json", many_pools_bundle(POOLS))
        settings = AllocatorSettings(etcd=",".join(etcd.endpoints), policy=str(policy), node_id="n1", port=1,
                                     prefix="/leasehold/", auth_disabled=True,
                                     # generous bounds: under valgrind every call is slow (a cost, not a latency, is measured)
                                     etcd_timeout_ms=30_000, election_ttl_s=60)
        app = create_app(settings)
        async with _lifespan(app):
            deadline = time.monotonic() + 30
            while not (app.state.election.is_leader and app.state.writer.store.txn_ops_known):
                if time.monotonic() > deadline:
                    raise RuntimeError("the allocator did not lead (and learn etcd's --max-txn-ops) within 30 s")
                await asyncio.sleep(0.05)
            body = lease_batch(POOLS, BATCH, tag="gcw")
            await _drive(app, [body(i) for i in range(warmup)])
            for r in range(rounds):
                body = lease_batch(POOLS, BATCH, tag=f"gc{r}")
                bodies = [body(i) for i in range(batches)]
                counts, etcd_cpu = etcd_counters(etcd.urls[0]), proc_cpu(etcd.procs[0].pid)
                cpu, wall = time.process_time(), time.perf_counter()
                granted = await _drive(app, bodies)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                etcd_cpu = proc_cpu(etcd.procs[0].pid) - etcd_cpu
                after = etcd_counters(etcd.urls[0])
                out.append((granted, cpu, wall, etcd_cpu,
                            {k: v - counts.get(k, 0.0) for k, v in after.items() if v != counts.get(k, 0.0)}))
    return out


def main(argv: list[str] | None = None) -> int:
    import uvloop

    ap = argparse.ArgumentParser(prog="python -m bench.grant_cost")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasehold-grant-cost-") as tmp:
        res = uvloop.run(measure(Path(tmp), a.batches, a.warmup, a.rounds))
    for granted, cpu, wall, etcd_cpu, counts in res:
        if granted != a.batches * BATCH:
            print(f"only {granted} of {a.batches * BATCH} items granted", file=sys.stderr)
            return 1
        print(f"{granted} grants: {cpu * 1e6 / granted:.1f} us CPU per grant (process), "
              f"{granted / wall:,.0f} grants/s in process; etcd {etcd_cpu * 1e6 / granted:.1f} us CPU per grant")
        print("  etcd per grant: " + ", ".join(f"{k} {v / granted:.4g}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
