"""A raw asyncio HTTP/1.1 keep-alive load generator, run as its own process so its CPU does
not compete inside the measured server's process and is reported separately.

    python -m bench.loadgen '{"port": 8080, "path": "/v1/admit", "workload": "admit", ...}'

Prints one JSON object: requests, errors, elapsed, rps, latency percentiles (ms), its own CPU
seconds, items (``items_per_request`` x 200 answers), and allowed answers per wall-clock window
when ``window_ms`` is given (each in the window of its round trip's midpoint, and — ``allowed_max``
— in every window its round trip touched) — with ``offered_marker``, also the answers that contain it per window
(e.g. ``"policyId":"<rule>"``: the attempts a pool's rule answered, admitted or denied — the demand
really offered to that pool, whatever rate the generator meant to send). ``ports`` (instead of
``port``) spreads the connections over several servers. Every loop is bounded by ``max_requests``
and ``duration_s``."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import sys
import time
from collections import Counter

from .stats import percentile
from .workloads import WORKLOADS

_LEN = re.compile(rb"content-length:\s*(\d+)", re.I)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _conn(cfg: dict, state: dict, wid: int) -> None:
    ports = cfg.get("ports") or [cfg["port"]]
    host, port, path = cfg.get("host", "127.0.0.1"), ports[wid % len(ports)], cfg["path"]
    body_of = state["body"]
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\nContent-Length: "
    head_b = head.encode()
    reader, writer = await asyncio.open_connection(host, port)
    interval = cfg["conns"] / cfg["rate"] if cfg.get("rate") else 0.0
    next_at = time.perf_counter() + (wid * interval / cfg["conns"] if interval else 0.0)
    window_ms = cfg.get("window_ms")
    count = cfg.get("count", "").encode()
    offered = cfg.get("offered_marker", "").encode()
    try:
        while True:
            now = time.perf_counter()
            if now >= state["end"] or state["sent"] >= state["max"]:
                return
            if interval:
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                next_at += interval
            i = state["sent"]
            state["sent"] += 1
            body = body_of(i)
            t0 = time.perf_counter()
            wall0 = time.time()
            writer.write(head_b + str(len(body)).encode() + b"\r\n\r\n" + body)
            headers = await reader.readuntil(b"\r\n\r\n")
            m = _LEN.search(headers)
            data = await reader.readexactly(int(m.group(1))) if m else b""
            t1 = time.perf_counter()
            if t0 >= state["measure_from"]:
                state["lat"].append(t1 - t0)
                if headers[9:12] == b"200":
                    state["ok"] += 1
                    if count:
                        state["counted"] += data.count(count)
                    state["fallback"] += data.count(b'"fallback":true')
                    if window_ms:
                        k = int((wall0 + (t1 - t0) / 2) * 1000 // window_ms)
                        n = data.count(b'"allowed":true')
                        state["allowed"][k] += n
                        # every window the answer may have been decided in (sent before a boundary,
                        # admitted after it: the next window's lease, waited for)
                        for kk in range(int(wall0 * 1000 // window_ms), int((wall0 + t1 - t0) * 1000 // window_ms) + 1):
                            state["allowed_max"][kk] += n
                        if offered:
                            state["offered"][k] += data.count(offered)
                else:
                    state["non200"] += 1
                    state["statuses"][headers[9:12].decode()] += 1
                    if not state["sample"]:
                        state["sample"] = data[:300].decode(errors="replace")
    finally:
        writer.close()


async def run(cfg: dict) -> dict:
    wl = cfg.get("workload_args", {})
    body = WORKLOADS[cfg["workload"]](**wl)
    start = time.perf_counter()
    warm = cfg.get("warmup_s", 0.0)
    state = {"body": body, "sent": cfg.get("start_index", 0), "max": cfg.get("start_index", 0) + cfg["max_requests"],
             "end": start + warm + cfg["duration_s"], "measure_from": start + warm, "lat": [], "ok": 0,
             "non200": 0, "allowed": Counter(), "allowed_max": Counter(), "offered": Counter(), "counted": 0, "fallback": 0, "statuses": Counter(), "sample": ""}
    cpu0 = _cpu()
    start_wall = time.time() + warm
    results = await asyncio.gather(*(_conn(cfg, state, w) for w in range(cfg["conns"])), return_exceptions=True)
    elapsed = time.perf_counter() - max(start + warm, start)
    cpu = _cpu() - cpu0
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    lat = state["lat"]
    n = len(lat)
    return {
        "requests": n, "ok": state["ok"], "non200": state["non200"], "errors": len(errors),
        "error_samples": errors[:3] + ([f"HTTP {dict(state['statuses'])}: {state['sample']}"] if state["sample"] else []), "elapsed_s": elapsed, "rps": state["ok"] / elapsed if elapsed > 0 else 0.0,
        "items_per_s": state["ok"] * cfg.get("items_per_request", 1) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": percentile(lat, 50) * 1000 if n else None, "p99_ms": percentile(lat, 99) * 1000 if n else None,
        "cpu_s": cpu, "cpu_pct": 100.0 * cpu / (time.perf_counter() - start),
        "allowed_by_window": {str(k): v for k, v in sorted(state["allowed"].items())},
        "allowed_max_by_window": {str(k): v for k, v in sorted(state["allowed_max"].items())},
        "offered_by_window": {str(k): v for k, v in sorted(state["offered"].items())},
        "counted": state["counted"], "fallback": state["fallback"], "counted_per_s": state["counted"] / elapsed if elapsed > 0 else 0.0,
        "start_wall": start_wall, "end_wall": time.time(),
        "sent": state["sent"] - cfg.get("start_index", 0),
    }


def main(argv: list[str] | None = None) -> int:
    cfg = json.loads((argv or sys.argv[1:])[0])
    import uvloop

    print(json.dumps(uvloop.run(run(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
