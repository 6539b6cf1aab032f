"""Where the RLS door's wall is, and what ``--workers N`` buys: an experiment run when named
(not a figure), every server a real process on a free loopback port, stopped by PID, all loaded
by figure 8's RLS load generator (one gRPC channel per server address, 64 in flight, 10k users)
and figure 2's HTTP load generator, alternated in the same minutes, ``--rounds`` times:

* bare constant-OK servers: ``grpc.aio`` on uvloop (the figure's ceiling), grpcio's synchronous
  server on a thread pool, and ``grpc.aio`` in 2 processes on one port (``grpc.so_reuseport``);
* the agent with ``--workers 1`` and ``--workers 2`` (each worker serves HTTP and RLS on the same
  ports): RLS calls/s, HTTP decisions/s (``POST /v1/admit``), CPU per call of the whole agent.

    python -m bench.rls_models [--rounds 3] [--seconds 3] [--out FILE.json]

With 2 workers, the RLS load generator opens one channel per connection group (``channels``),
since a single HTTP/2 connection lands on one worker only, as a single Envoy worker's would."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from leasehold.local.procs import Proc, RedisServer, free_port, wait_port

from .fig_gateways import gwload
from .harness import CpuMeter, _env, loadgen, services, start_agent
from .stats import median

CONNS = 64


def _bare(work: Path, name: str, *args: str, module: str = "bench.rls_bare") -> tuple[Proc, int]:
    """A gRPC server process, ``python -m <module> --port N <args>`` (``module`` may be followed by a
    subcommand, e.g. ``"bench.rls_budget serve"``), on a free loopback port, once it listens."""
    port = free_port()
    p = Proc(name, [sys.executable, "-m", *module.split(), "--port", str(port), *args], work / name,
             env=_env()).start()
    wait_port(port, proc=p.popen, timeout=30)
    return p, port


def run(work: Path, rounds: int, seconds: float) -> dict:
    redis = RedisServer(work / "redis").start()
    procs: list = []
    rls: dict[str, tuple[int, int, int]] = {}  # name -> (port, pid, channels)
    http: dict[str, tuple[int, int]] = {}
    with services(redis):
        try:
            for name, args, ch in (("bare_aio", (), 1), ("bare_sync8", ("--server", "sync", "--threads", "8"), 1),
                                   ("bare_aio_x2", ("--processes", "2"), 8)):
                p, port = _bare(work, name, *args)
                procs.append(p)
                rls[name] = (port, p.pid, ch)
            for workers in (1, 2):
                rls_port = free_port()
                a = start_agent(work / f"agent-w{workers}", redis.url, workers=workers, region=f"w{workers}",
                                extra=["--rls-port", str(rls_port)])
                procs.append(a)
                wait_port(rls_port, proc=a.proc.popen, timeout=30)
                rls[f"agent_w{workers}"] = (rls_port, a.proc.pid, 1 if workers == 1 else 8)
                http[f"agent_w{workers}"] = (a.port, a.proc.pid)
            res: dict[str, list[dict]] = {}
            for t in range(rounds):
                for name, (port, pid, ch) in rls.items():
                    with CpuMeter({"server": pid}) as m:
                        out = gwload({"mode": "rls", "port": port, "conns": CONNS, "channels": ch,
                                      "duration_s": seconds, "warmup_s": 0.5, "principals": 10_000,
                                      "tenant": f"m{t}", "max_requests": 2_000_000})
                    res.setdefault(f"rls:{name}", []).append(
                        {"rps": out["rps"], "p50_ms": out["p50_ms"], "p99_ms": out["p99_ms"],
                         "cpu_us": m.per(out["sent"]).get("server"), "machine_cores": m.machine_cores,
                         "loadgen_cpu_pct": out["cpu_pct"]})
                for name, (port, pid) in http.items():
                    with CpuMeter({"server": pid}) as m:
                        out = loadgen({"port": port, "path": "/v1/admit", "workload": "admit", "conns": CONNS,
                                       "workload_args": {"principals": 10_000, "tag": f"m{name}{t}"},
                                       "duration_s": seconds, "warmup_s": 0.5, "max_requests": 2_000_000})
                    res.setdefault(f"http:{name}", []).append(
                        {"rps": out["rps"], "p50_ms": out["p50_ms"], "p99_ms": out["p99_ms"],
                         "cpu_us": m.per(out["sent"]).get("server"), "machine_cores": m.machine_cores,
                         "loadgen_cpu_pct": out["cpu_pct"]})
        finally:
            for p in reversed(procs):
                p.stop()
    summary = {k: {f: median(x[f] for x in v) for f in ("rps", "p50_ms", "p99_ms", "cpu_us", "machine_cores")}
               for k, v in res.items()}
    return {"trials": res, "medians": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rls_models")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasehold-rls-models-") as tmp:
        out = run(Path(tmp), a.rounds, a.seconds)
    text = json.dumps(out, indent=1)
    if a.out:
        a.out.write_text(text)
    for k, v in out["medians"].items():
        print(f"{k:22s} {v['rps']:9,.0f}/s  p50 {v['p50_ms']:7.1f} ms  p99 {v['p99_ms']:7.1f} ms  "
              f"CPU {v['cpu_us'] or 0:6.0f} us/call  machine {v['machine_cores']:.2f} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
