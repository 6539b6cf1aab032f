"""Figure 8's RLS rows alone, A/B: the agent of this checkout against the agent of another source
tree (``--base``, e.g. a ``git archive`` of ``main`` unpacked, put first on ``PYTHONPATH`` of its
process) and the bare ``grpc.aio`` constant-OK server, alternated in the same minutes, ``--rounds``
times, with figure 8's RLS load generator (one channel, 64 in flight, 10k users). Per round and
server: calls/s, p50/p99, server CPU per call (and an agent's Redis's: the scripts, the protocol, the
socket I/O), the ratio to the bare server of the same round.

    python -m bench.rls_ab [--base /tmp/main-src] [--rounds 4] [--seconds 3] [--agent-args '...']
    python -m bench.rls_ab --variant linger2='--rls-group-linger-ms 2' --variant linger0='--rls-group-linger-ms 0'

An experiment for changes to the RLS door (figure 8 runs its whole gateway set); every process a
real one on a free loopback port, stopped by PID."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

from leasehold.local.procs import Proc, RedisServer, free_port, wait_port

from .fig_gateways import CONNS, gwload
from .harness import CpuMeter, _env, redis_client, services, start_agent
from .stats import median


def split_flags(extra: list[str]) -> tuple[dict[str, str], list[str]]:
    """(environment, flags) of an agent's extra arguments: ``env:KEY=VALUE`` items go to its
    environment (an experiment's switch), the rest are its flags."""
    env = dict(x[4:].split("=", 1) for x in extra if x.startswith("env:"))
    return env, [x for x in extra if not x.startswith("env:")]


CHECKOUT = Path(__file__).resolve().parents[1]  # the source tree this module is part of


def _agent(work: Path, redis_url: str, name: str, base: Path | None, extra: list[str]):
    """An agent process of this checkout, or of ``base``: that tree first on its ``PYTHONPATH``
    (the agent runs in a directory of its own, where ``python -m region_agent`` would otherwise
    import whichever tree the environment has installed — another worktree's, say)."""
    port = free_port()
    env, flags = split_flags(extra)
    tree = base if base is not None else CHECKOUT
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        a = start_agent(work / name, redis_url, region=name, extra=["--rls-port", str(port), *flags])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wait_port(port, proc=a.proc.popen, timeout=30)
    return a, port


GROUP_METRICS = (("calls_per_group", "leasehold_agent_rls_group_calls"),
                 ("calls_per_pipeline", "leasehold_agent_batch_size"))


def group_sizes(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the RLS group sizes and the Redis pipeline sizes in an agent's ``/metrics``."""
    out = {key: [0.0, 0.0] for key, _ in GROUP_METRICS}
    for line in metrics_text.splitlines():
        for key, metric in GROUP_METRICS:
            for i, suffix in enumerate(("_sum", "_count")):
                if line.startswith((f"{metric}{suffix} ", f"{metric}{suffix}{{")):
                    out[key][i] += float(line.rpartition(" ")[2])
    return {k: (v[0], v[1]) for k, v in out.items()}


def _groups(agent) -> dict[str, tuple[float, float]]:
    return group_sizes(httpx.get(agent.url + "/metrics", timeout=5).text)


def run(work: Path, base: Path | None, rounds: int, seconds: float, extra: list[str],
        variants: dict[str, list[str]] | None = None, conns: int = CONNS) -> dict:
    redis = RedisServer(work / "redis").start()
    with services(redis):
        procs: list = []
        try:
            servers: dict[str, tuple[int, int]] = {}
            bare_port = free_port()
            bare = Proc("rls-bare", [sys.executable, "-m", "bench.rls_bare", "--port", str(bare_port)],
                        work / "bare", env=_env()).start()
            procs.append(bare)
            wait_port(bare_port, proc=bare.popen, timeout=30)
            servers["bare"] = (bare_port, bare.pid)
            if base is not None:
                a, port = _agent(work, redis.url, "base", base, extra)
                procs.append(a)
                servers["base"] = (port, a.proc.pid)
            for name, args in (variants or {"branch": []}).items():
                a, port = _agent(work, redis.url, name, None, [*extra, *args])
                procs.append(a)
                servers[name] = (port, a.proc.pid)
            res: dict[str, list[dict]] = {k: [] for k in servers}
            store = redis_client(redis)  # the agents' Redis: its CPU per call beside theirs
            agents = {name: a for name, a in zip((n for n in servers if n != "bare"), procs[1:], strict=True)}
            for t in range(rounds):
                order = list(servers) if t % 2 == 0 else list(reversed(servers))
                for name in order:
                    port, pid = servers[name]
                    g0 = _groups(agents[name]) if name in agents else None
                    with CpuMeter({"server": pid}, store if name != "bare" else None) as m:
                        out = gwload({"mode": "rls", "port": port, "conns": conns, "duration_s": seconds,
                                      "warmup_s": 0.5, "principals": 10_000, "tenant": f"ab{t}",
                                      "max_requests": 2_000_000})
                    per = m.per(out["sent"])
                    res[name].append({"rps": out["rps"], "p50_ms": out["p50_ms"], "p99_ms": out["p99_ms"],
                                      "cpu_us": per.get("server"), "redis_cpu_us": per.get("redis", 0.0),
                                      "machine_cores": m.machine_cores, "loadgen_cpu_pct": out["cpu_pct"]})
                    if g0 is not None:
                        g1 = _groups(agents[name])
                        res[name][-1].update({k: (g1[k][0] - g0[k][0]) / max(1.0, g1[k][1] - g0[k][1]) for k in g1})
            store.close()
        finally:
            for p in reversed(procs):
                p.stop()
    for name in res:
        for t, x in enumerate(res[name]):
            b = res["bare"][t]
            x["ratio"] = x["rps"] / b["rps"] if b["rps"] else None
            x["p50_x"] = x["p50_ms"] / b["p50_ms"] if b["p50_ms"] else None
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rls_ab")
    ap.add_argument("--base", type=Path, help="another source tree whose agent is measured beside this one")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--conns", type=int, default=CONNS, help="calls in flight")
    ap.add_argument("--agent-args", default="", help="more flags for both agents")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="an agent of this checkout with more flags (repeatable; default one, 'branch')")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasehold-rls-ab-") as tmp:
        variants = {n: shlex.split(f) for n, _, f in (v.partition("=") for v in a.variant)} or None
        res = run(Path(tmp), a.base.resolve() if a.base else None, a.rounds, a.seconds, shlex.split(a.agent_args),
                  variants, a.conns)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    for name, xs in res.items():
        rps = ", ".join(f"{x['rps']:,.0f}" for x in xs)
        ratios = ", ".join(f"{x['ratio']:.2f}" for x in xs)
        cpu = ", ".join(f"{x['cpu_us'] or 0:.0f}" for x in xs)
        busy = ", ".join(f"{x['machine_cores']:.1f}" for x in xs)
        store = ", ".join(f"{x['redis_cpu_us']:.0f}" for x in xs)
        if "calls_per_group" in xs[0]:
            rps += (f" [calls/group {median(x['calls_per_group'] for x in xs):.1f}, "
                    f"calls/pipeline {median(x['calls_per_pipeline'] for x in xs):.1f}]")
        print(f"{name:8s} calls/s {rps}; ratio {ratios} (median {median(x['ratio'] for x in xs):.3f}); "
              f"p50 x{median(x['p50_x'] for x in xs):.2f}; CPU us/call {cpu} (Redis {store}); machine {busy} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
