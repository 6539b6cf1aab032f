"""Instructions and cache misses per RLS call of a whole server process: the bare ``grpc.aio``
constant-OK server (figure 8's ceiling) or the agent, each under cachegrind with this host's caches
simulated (``bench.instructions.HOST_CACHES``), driven by figure 8's RLS load generator
(``bench.gwload``: one channel, ``--inflight`` calls in flight, 10,000 users) for a small and then a
large count of calls, stopped by SIGTERM. Per call = (the large run's counts - the small run's) /
(the difference of the counts of calls): the start-up, the imports and the first calls cancel out;
what scales with a run's wall time (timers, the agent's store health poll) does not quite, so the
two runs' wall times are printed beside.

Unlike ``bench.instructions`` (the decision and the door in process), this counts everything the
process does for a call: CPython, grpcio's C core and its threads, uvloop, protobuf, and for the
agent its door, decision and redis-py. Under valgrind a call takes milliseconds, so the agent's
RLS groups hold about one call whatever the linger: its count is the agent without groups. The
agent's Redis runs outside valgrind; the decision budget and the Redis read bound are 5 s
(thresholds only), and every call must be answered ``OK`` or the pair is refused.

    python -m bench.process_cost [--server bare|agent] [--calls 1000,3000] [--inflight 64] [--LL size,assoc,line]

Every process a real one on a free loopback port, stopped by PID."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from leasehold.local.procs import RedisServer, free_port, wait_port
from leasehold.local.services import agent_command
from leasehold.local.topology import DEV_PEPPER

from .fig_gateways import CONNS, gwload
from .harness import NORTHSTAR, _env
from .instructions import HOST_CACHES, cache_counts
from .rls_ab import group_sizes

LIMIT_MS = 5_000  # the agent's decision budget and Redis read bound under valgrind (thresholds only)
CALL_TIMEOUT_S = 1_200.0  # the load generator's per-call deadline: a call under valgrind is slow


def per_call(small: dict[str, int], large: dict[str, int], n_small: int, n_large: int) -> dict[str, float]:
    """Counts per call between two runs of ``n_small`` and ``n_large`` calls (the events both runs
    counted), with the L2 misses (code and data) per 1,000 instructions."""
    n = n_large - n_small
    if n <= 0:
        raise ValueError("the large run must make more calls than the small one")
    out = {k: (large[k] - small[k]) / n for k in small if k in large}
    if {"I", "LLi", "LLd"} <= out.keys() and out["I"] > 0:
        out["LL_per_1000"] = 1000 * (out["LLi"] + out["LLd"]) / out["I"]
    return out


def _command(server: str, port: int, redis_url: str | None, http_port: int, linger_ms: float) -> list[str]:
    if server == "bare":
        return [sys.executable, "-m", "bench.rls_bare", "--port", str(port)]
    return agent_command("--rls-port", str(port), "--decision-budget-ms", str(LIMIT_MS),
                         "--redis-socket-timeout-ms", str(LIMIT_MS), "--rls-group-linger-ms", str(linger_ms),
                         redis_url=redis_url, policy=NORTHSTAR, region="cost", host="127.0.0.1", port=http_port,
                         workers=1, log_level="warning")


def one_run(work: Path, server: str, calls: int, inflight: int, caches: dict[str, str], redis_url: str | None,
            linger_ms: float) -> dict:
    """One server process under cachegrind answering ``calls`` calls: its counts, the calls
    answered ``OK``, its groups (the agent) and the run's wall time."""
    import httpx

    work.mkdir(parents=True, exist_ok=True)
    port, http_port = free_port(), free_port()
    vg = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *(f"--{k}={v}" for k, v in caches.items()),
          f"--cachegrind-out-file={work / 'cachegrind.out'}"]
    env = _env(LEASEHOLD_AGENT_PEPPER=DEV_PEPPER, PYTHONHASHSEED="0")
    t0 = time.monotonic()
    with open(work / "stdout", "w") as out, open(work / "stderr", "w") as err:
        p = subprocess.Popen(vg + _command(server, port, redis_url, http_port, linger_ms), cwd=work, env=env,
                             stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
    groups: dict = {}
    try:
        wait_port(port, proc=p, timeout=900)
        if server == "agent":
            wait_port(http_port, proc=p, timeout=900)
            g0 = group_sizes(httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=60).text)
        res = gwload({"mode": "rls", "port": port, "conns": inflight, "duration_s": 3_600, "warmup_s": 0.0,
                      "principals": 10_000, "tenant": "cost", "max_requests": calls, "call_timeout_s": CALL_TIMEOUT_S})
        if server == "agent":
            g1 = group_sizes(httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=60).text)
            groups = {k: (g1[k][0] - g0[k][0]) / max(1.0, g1[k][1] - g0[k][1]) for k in g1}
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
        p.wait(900)
    return {"counts": cache_counts((work / "stderr").read_text()), "ok": res["ok"], "groups": groups,
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.process_cost")
    ap.add_argument("--server", choices=("bare", "agent"), default="bare")
    ap.add_argument("--calls", default="1000,3000", help="the small and the large run's calls")
    ap.add_argument("--inflight", type=int, default=CONNS)
    ap.add_argument("--linger-ms", type=float, default=2.0, help="the agent's --rls-group-linger-ms")
    ap.add_argument("--LL", default=HOST_CACHES["LL"], help="the last level simulated (size,assoc,line)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    try:
        small, large = (int(x) for x in a.calls.split(","))
    except ValueError:
        ap.error("--calls: two counts, e.g. 1000,3000")
    if not 0 < small < large:
        ap.error("--calls: 0 < small < large")
    caches = dict(HOST_CACHES, LL=a.LL)
    with tempfile.TemporaryDirectory(prefix="leasehold-process-cost-") as tmp:
        redis = RedisServer(Path(tmp) / "redis").start() if a.server == "agent" else None
        try:
            url = redis.url if redis is not None else None
            runs = [one_run(Path(tmp) / f"{a.server}-{n}", a.server, n, a.inflight, caches, url, a.linger_ms)
                    for n in (small, large)]
        finally:
            if redis is not None:
                redis.stop()
    result = {"server": a.server, "calls": [small, large], "runs": runs,
              "per_call": per_call(runs[0]["counts"], runs[1]["counts"], small, large)}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    refused = [f"{r['ok']} of {n} calls answered OK" for r, n in zip(runs, (small, large), strict=True) if r["ok"] != n]
    pc = result["per_call"]
    print(f"{a.server}: per call {pc['I']:,.0f} instructions; "
          + "; ".join(f"{k} {pc[k]:,.0f}" for k in ("D", "D1", "LLd", "I1", "LLi") if k in pc)
          + (f"; L2 misses per 1,000 instructions {pc['LL_per_1000']:.1f}" if "LL_per_1000" in pc else "")
          + f"; runs' wall time {runs[0]['wall_s']} s and {runs[1]['wall_s']} s"
          + (f"; calls per group {runs[1]['groups'].get('calls_per_group', 0):.2f}" if runs[1]["groups"] else "")
          + (f" (REFUSED: {', '.join(refused)})" if refused else ""))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
