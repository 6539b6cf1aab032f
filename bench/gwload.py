"""Load generators of figure 8, each run as its own process (its CPU reported separately):

* ``rls`` — ``ShouldRateLimit`` calls on one gRPC channel (as Envoy holds one HTTP/2 connection
  per worker), ``conns`` in flight, one descriptor per call (tenant, user of ``principals``,
  route group ``read``);
* ``http`` — ``GET path`` on ``conns`` raw HTTP/1.1 keep-alive connections, each client with its
  bearer token (``tokens_file``: one ``Authorization`` value per line, user ``U-<line>``, which
  Envoy's ``jwt_authn`` verifies), the connections spread over the loopback ``sources`` (every
  request spends its address's window first, as real clients from many addresses would).

    python -m bench.gwload '{"mode": "rls", "port": N, "conns": 64, "duration_s": 3, ...}'

Prints one JSON object (requests, ok, rps of OK answers, p50/p99 ms, statuses, cpu). Bounded by
``duration_s`` and ``max_requests``."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import sys
import time
from collections import Counter

from .stats import percentile

_LEN = re.compile(rb"content-length:\s*(\d+)", re.I)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _state(cfg: dict) -> dict:
    start = time.perf_counter()
    return {"sent": 0, "max": cfg.get("max_requests", 2_000_000), "measure_from": start + cfg.get("warmup_s", 0.0),
            "end": start + cfg.get("warmup_s", 0.0) + cfg["duration_s"], "lat": [], "ok": 0, "codes": Counter(),
            "start": start}


def _record(state: dict, t0: float, t1: float, code: str, ok: bool) -> None:
    if t0 >= state["measure_from"]:
        state["lat"].append(t1 - t0)
        state["codes"][code] += 1
        state["ok"] += ok


async def _rls_worker(cfg: dict, state: dict, stub, pb) -> None:
    tenant, n = cfg.get("tenant", "bench"), cfg.get("principals", 10_000)
    D = pb["D"]
    while True:
        now = time.perf_counter()
        if now >= state["end"] or state["sent"] >= state["max"]:
            return
        i = state["sent"]
        state["sent"] += 1
        req = pb["Request"](domain="leasehold", descriptors=[D(entries=[
            D.Entry(key="tenant", value=tenant), D.Entry(key="user", value=f"U-{i % n}"),
            D.Entry(key="route_group", value="read")])])
        t0 = time.perf_counter()
        resp = await stub.ShouldRateLimit(req, timeout=cfg.get("call_timeout_s", 5))
        code = pb["Code"].Name(resp.overall_code)
        _record(state, t0, time.perf_counter(), code, code == "OK")


async def run_rls(cfg: dict, state: dict) -> list:
    import grpc
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    pb = {"D": ratelimit_pb2.RateLimitDescriptor, "Request": rls_pb2.RateLimitRequest,
          "Code": rls_pb2.RateLimitResponse.Code}
    # ``channels`` > 1: that many separate connections (each its own subchannel, so a server of
    # several processes on one port sees them spread), the in-flight calls divided among them
    n = max(1, cfg.get("channels", 1))
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{cfg['port']}", options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(n)]
    try:
        stubs = [rls_pb2_grpc.RateLimitServiceStub(ch) for ch in chans]
        return await asyncio.gather(*(_rls_worker(cfg, state, stubs[w % n], pb) for w in range(cfg["conns"])),
                                    return_exceptions=True)
    finally:
        for ch in chans:
            await ch.close()


async def _http_conn(cfg: dict, state: dict, source: str | None, heads: list[bytes]) -> None:
    host, port = "127.0.0.1", cfg["port"]
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0) if source else None)
    n = len(heads)
    try:
        while True:
            now = time.perf_counter()
            if now >= state["end"] or state["sent"] >= state["max"]:
                return
            i = state["sent"]
            state["sent"] += 1
            t0 = time.perf_counter()
            writer.write(heads[i % n])
            headers = await reader.readuntil(b"\r\n\r\n")
            m = _LEN.search(headers)
            if m:
                await reader.readexactly(int(m.group(1)))
            code = headers[9:12].decode()
            _record(state, t0, time.perf_counter(), code, code == "200")
    finally:
        writer.close()


async def run_http(cfg: dict, state: dict) -> list:
    host, port, path = "127.0.0.1", cfg["port"], cfg.get("path", "/catalog")
    bearers = cfg["bearers"][:cfg.get("principals", 10_000)]
    heads = [f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nauthorization: {b}\r\n\r\n".encode() for b in bearers]
    sources = cfg.get("sources") or [None]
    return await asyncio.gather(*(_http_conn(cfg, state, sources[c % len(sources)], heads)
                                  for c in range(cfg["conns"])), return_exceptions=True)


async def run(cfg: dict) -> dict:
    state = _state(cfg)
    cpu0 = _cpu()
    results = await (run_rls if cfg["mode"] == "rls" else run_http)(cfg, state)
    elapsed = time.perf_counter() - state["measure_from"]
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    lat = state["lat"]
    return {"requests": len(lat), "ok": state["ok"], "errors": len(errors), "error_samples": errors[:3],
            "statuses": dict(state["codes"]), "elapsed_s": elapsed, "rps": state["ok"] / elapsed if elapsed > 0 else 0.0,
            "p50_ms": percentile(lat, 50) * 1000 if lat else None, "p99_ms": percentile(lat, 99) * 1000 if lat else None,
            "cpu_s": _cpu() - cpu0, "cpu_pct": 100.0 * (_cpu() - cpu0) / (time.perf_counter() - state["start"]),
            "sent": state["sent"]}


def main(argv: list[str] | None = None) -> int:
    cfg = json.loads((argv or sys.argv[1:])[0])
    if cfg.get("tokens_file"):
        with open(cfg["tokens_file"]) as f:
            cfg["bearers"] = [line.strip() for line in f if line.strip()]
    import uvloop

    print(json.dumps(uvloop.run(run(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
