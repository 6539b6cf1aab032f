"""System calls and CPU per call of each server process of a door, beside its ceiling: figure 8's
RLS load (one channel, 64 in flight, 10k users) on the agent and the bare ``grpc.aio`` constant-OK
server, or (``--http``) figure 2's ``POST /v1/admit`` load (64 connections) on the agent and the raw
ASGI echo; the agent's ``redis-server`` counted with it. Alternated ``--rounds`` times on one Redis.

Per round and process: system calls per call by thread name and kind (``perf stat --per-thread`` on
the tracepoints ``raw_syscalls:sys_enter`` — all of them — and ``syscalls:sys_enter_<name>`` for the
names of ``--calls``, with ``context-switches``), attached for the whole load-generator run and
divided by the calls sent; CPU per call by thread name, user and kernel time apart, from
``/proc/<pid>/task/*/stat``. Counts do not depend on the machine's load (tracing slows the servers
down: read CPU from a ``--no-perf`` run).

    python -m bench.syscalls [--http] [--rounds 2] [--seconds 3] [--base /tmp/main-src] [--no-perf]

Needs ``perf`` with tracepoints readable (root, or ``kernel.perf_event_paranoid`` <= -1). Every
process a real one on a free loopback port, stopped by PID."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from leasehold.local.procs import Proc, RedisServer, free_port, wait_port

from .fig_gateways import CONNS, gwload
from .harness import _env, loadgen, services, start_echo
from .rls_ab import _agent, _groups
from .stats import median

CALLS = ("read,recvfrom,recvmsg,write,writev,sendto,sendmsg,epoll_wait,epoll_pwait,epoll_ctl,futex,getpid,"
         "clock_gettime,poll,ppoll,madvise,mmap,munmap,brk")
TOTAL = "raw_syscalls:sys_enter"
SWITCHES = "context-switches"
PREFIX = "syscalls:sys_enter_"


def perf_events(calls: str) -> str:
    return ",".join([TOTAL, SWITCHES, *(PREFIX + c for c in calls.split(",") if c)])


def parse_perf(text: str) -> dict[str, Counter]:
    """``perf stat -x ';' --per-thread`` output: counts by thread name (the ``comm-tid`` column
    without its thread id, the threads of one name summed) and event (a system call's tracepoint by
    the call's name). Lines of uncounted events (``<not counted>``) and comments are left out."""
    out: dict[str, Counter] = defaultdict(Counter)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        f = line.split(";")
        if len(f) < 4 or not f[1].isdigit():
            continue
        event = f[3].removeprefix(PREFIX)
        out[f[0].rsplit("-", 1)[0]][event] += int(f[1])
    return dict(out)


def parse_stat(line: str, ticks: int) -> tuple[str, float, float]:
    """A ``/proc/<pid>/task/<tid>/stat`` line: (thread name, user seconds, kernel seconds)."""
    name = line[line.index("(") + 1:line.rindex(")")]
    f = line[line.rindex(")") + 2:].split()
    return name, int(f[11]) / ticks, int(f[12]) / ticks


def thread_cpu(pids: Iterable[int]) -> dict[tuple[int, int], tuple[str, float, float]]:
    """CPU of every thread of ``pids`` by (pid, tid), and of each whole process under (pid, 0) as
    thread name ``(process)``: a process's own times include its threads that have exited (grpcio's
    event-engine threads come and go)."""
    ticks = os.sysconf("SC_CLK_TCK")
    res = {}
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                res[(p, 0)] = ("(process)", *parse_stat(fh.read(), ticks)[1:])
        except (OSError, ValueError):
            pass
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{t}/stat") as fh:
                    res[(p, int(t))] = parse_stat(fh.read(), ticks)
            except (OSError, ValueError):
                continue
    return res


STAT_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu() -> tuple[float, dict[str, float]]:
    """(monotonic seconds, the whole machine's CPU seconds by ``/proc/stat`` column): the time no
    process is charged with too — interrupts and softirqs (loopback TCP's receive path is run in
    them), time the hypervisor took from the vCPUs (``steal``), and idle."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as fh:
        f = fh.readline().split()
    return time.monotonic(), {k: int(v) / ticks for k, v in zip(STAT_COLUMNS, f[1:], strict=False)}


class MachineSampler:
    """``/proc/stat`` read every ``every`` seconds in a thread while a load runs, so that the
    machine's CPU can be read over the load generator's measured window alone (not its start-up)."""

    def __init__(self, every: float = 0.2):
        self.every, self.samples = every, [machine_cpu()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(machine_cpu())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(machine_cpu())

    def window_per_call(self, elapsed_s: float, rps: float) -> dict[str, float]:
        """us per call of each ``/proc/stat`` column over the last ``elapsed_s`` seconds before the
        load ended (its measured window, 0.3 s trimmed at each end: the generator's exit), at
        ``rps`` calls a second, and the cores busy there (all but idle and iowait)."""
        end = self.samples[-1][0]
        inside = [s for s in self.samples if end - elapsed_s + 0.3 <= s[0] <= end - 0.3] or self.samples
        (t0, a), (t1, b) = inside[0], inside[-1]
        span = max(1e-9, t1 - t0)
        out = {k: round((b[k] - a[k]) / span * 1e6 / max(1e-9, rps), 1) for k in STAT_COLUMNS}
        out["busy_cores"] = round(sum(b[k] - a[k] for k in STAT_COLUMNS if k not in ("idle", "iowait")) / span, 2)
        return out


def thread_waits(pids: Iterable[int]) -> dict[tuple[int, int], tuple[str, float, int]]:
    """Every thread's time spent runnable but waiting for a CPU (seconds) and its count of turns
    on a CPU, by (pid, tid), from ``/proc/<pid>/task/<tid>/schedstat``: a thread that waits long
    there is short of CPU; one that does not, but is not busy either, waits for something else."""
    res = {}
    for p in pids:
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                with open(f"/proc/{p}/task/{t}/comm") as fh:
                    name = fh.read().strip()
                with open(f"/proc/{p}/task/{t}/schedstat") as fh:
                    _, wait_ns, turns = fh.read().split()
            except (OSError, ValueError):
                continue
            res[(p, int(t))] = (name, int(wait_ns) / 1e9, int(turns))
    return res


def _by_thread_name(before: dict, after: dict, calls: int, fields: tuple[tuple[str, float], ...],
                    digits: int) -> dict[str, dict[str, float]]:
    """Per call, by thread name, each of ``fields`` (its name and its scale) from the threads'
    ``(name, *values)`` read before and after: the threads of one name summed, a thread that started
    during the run counted from zero."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((f for f, _ in fields), 0.0))
    for key, (name, *values) in after.items():
        _, *old = before.get(key, (name, *(0 for _ in fields)))
        for (field, scale), v, v0 in zip(fields, values, old, strict=True):
            out[name][field] += (v - v0) * scale / max(1, calls)
    return {k: {x: round(v, digits) for x, v in d.items()} for k, d in out.items()}


def waits_per_call(before: dict, after: dict, calls: int) -> dict[str, dict[str, float]]:
    """us per call waiting for a CPU and turns on a CPU per call, by thread name."""
    return _by_thread_name(before, after, calls, (("wait", 1e6), ("turns", 1.0)), 2)


def cpu_per_call(before: dict, after: dict, calls: int) -> dict[str, dict[str, float]]:
    """us per call by thread name, user and kernel apart."""
    return _by_thread_name(before, after, calls, (("user", 1e6), ("sys", 1e6)), 1)


def per_call(counts: dict[str, Counter], calls: int, floor: float = 0.01) -> dict[str, dict[str, float]]:
    """Counts per call by thread name and event; events below ``floor`` a call left out."""
    return {comm: {ev: round(n / max(1, calls), 3) for ev, n in c.most_common() if n / max(1, calls) >= floor}
            for comm, c in counts.items()}


def measure(targets: dict[str, list[int]], load: Callable[[], dict], work: Path, calls: str | None) -> dict:
    """Run ``load`` with ``perf stat`` on each target's processes (unless ``calls`` is None) and
    their threads' CPU read around it; per target, counts and CPU per call sent."""
    perfs = {}
    before = {name: thread_cpu(pids) for name, pids in targets.items()}
    waits0 = {name: thread_waits(pids) for name, pids in targets.items()}
    sampler = MachineSampler()
    try:
        if calls is not None:
            for name, pids in targets.items():
                out = work / f"perf-{name}.txt"
                perfs[name] = (subprocess.Popen(["perf", "stat", "-x", ";", "--per-thread", "-e", perf_events(calls),
                                                 "-p", ",".join(map(str, pids)), "-o", str(out)],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out)
            wait_attached(perfs)
        res = load()
    finally:
        sampler.stop()
        counts = {}
        for name, (p, out) in perfs.items():
            p.send_signal(signal.SIGINT)
            p.wait(30)
            counts[name] = parse_perf(out.read_text()) if out.exists() else {}
    n = res["sent"]
    row = {"sent": n, "rps": res["rps"], "p50_ms": res["p50_ms"], "loadgen_cpu_us": res["cpu_s"] * 1e6 / max(1, n),
           "machine_us": sampler.window_per_call(res["elapsed_s"], res["rps"])}
    for name, pids in targets.items():
        row[name] = {"cpu_us": cpu_per_call(before[name], thread_cpu(pids), n),
                     "waits": waits_per_call(waits0[name], thread_waits(pids), n)}
        if name in counts:
            row[name]["per_call"] = per_call(counts[name], n)
    return row


def wait_attached(perfs: dict) -> None:
    """``perf stat -p`` counts from when its events are open: wait until each process holds them
    (its ``perf_event`` file descriptors exist), or has exited (the load run then fails loudly)."""
    for p, _ in perfs.values():
        while p.poll() is None:
            try:
                fds = os.listdir(f"/proc/{p.pid}/fd")
                if any("perf_event" in os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in fds):
                    break
            except OSError:
                pass
            try:
                p.wait(0.05)
            except subprocess.TimeoutExpired:
                pass


def children(pid: int) -> list[int]:
    """``pid`` and its direct children (a server of several worker processes)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [pid, *(int(x) for x in fh.read().split())]
    except OSError:
        return [pid]


def run(work: Path, http: bool, base: Path | None, rounds: int, seconds: float, calls: str | None) -> list[dict]:
    redis = RedisServer(work / "redis").start()
    rows: list[dict] = []
    with services(redis):
        procs: list = []
        agents: dict = {}  # the RLS agents: their group and pipeline sizes read around each round
        try:
            servers: dict[str, tuple[int, dict[str, list[int]]]] = {}
            store = [redis.proc.pid]
            if http:
                raw = start_echo(work / "raw", module="bench.raw_echo")
                procs.append(raw)
                servers["raw"] = (raw.port, {"server": children(raw.proc.pid)})
            else:
                port = free_port()
                bare = Proc("rls-bare", [sys.executable, "-m", "bench.rls_bare", "--port", str(port)], work / "bare",
                            env=_env()).start()
                procs.append(bare)
                wait_port(port, proc=bare.popen, timeout=30)
                servers["bare"] = (port, {"server": [bare.pid]})
            for name, tree in [*([("base", base)] if base is not None else []), ("branch", None)]:
                a, rls_port = _agent(work, redis.url, name, tree, [])
                procs.append(a)
                servers[name] = (a.port if http else rls_port, {"server": children(a.proc.pid), "redis": store})
                if not http:
                    agents[name] = a
            for t in range(rounds):
                order = list(servers) if t % 2 == 0 else list(reversed(servers))
                for name in order:
                    port, targets = servers[name]
                    if http:
                        cfg = {"port": port, "path": "/v1/admit", "workload": "admit", "count": '"allowed":true',
                               "workload_args": {"principals": 10_000, "tag": f"sc{t}{name}"}, "conns": 64,
                               "duration_s": seconds, "warmup_s": 0.5, "max_requests": 2_000_000}
                        load = partial(loadgen, cfg)
                    else:
                        cfg = {"mode": "rls", "port": port, "conns": CONNS, "duration_s": seconds, "warmup_s": 0.5,
                               "principals": 10_000, "tenant": f"sc{t}{name}", "max_requests": 2_000_000}
                        load = partial(gwload, cfg)
                    g0 = _groups(agents[name]) if name in agents else None
                    rows.append({"name": name, "round": t, **measure(targets, load, work, calls)})
                    if g0 is not None:
                        g1 = _groups(agents[name])
                        rows[-1].update({k: round((g1[k][0] - g0[k][0]) / max(1.0, g1[k][1] - g0[k][1]), 2)
                                         for k in g1})
        finally:
            for p in reversed(procs):
                p.stop()
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per server: calls/s of each round, then per process, thread name and event the median per
    call over the rounds (a round without the event counts as 0) and CPU per call."""
    lines = []
    for name in dict.fromkeys(r["name"] for r in rows):
        rs = [r for r in rows if r["name"] == name]
        rps = ", ".join(f"{r['rps']:,.0f}" for r in rs)
        lines.append(f"{name}: calls/s {rps}; load generator CPU us/call "
                     + ", ".join(f"{r['loadgen_cpu_us']:.0f}" for r in rs))
        if all("calls_per_group" in r for r in rs):
            lines.append("  calls per group " + ", ".join(f"{r['calls_per_group']:.1f}" for r in rs)
                         + "; calls per Redis pipeline " + ", ".join(f"{r['calls_per_pipeline']:.1f}" for r in rs))
        if all("machine_us" in r for r in rs):
            for col in (*STAT_COLUMNS, "busy_cores"):
                lines.append(f"  machine {col}: " + ", ".join(f"{r['machine_us'][col]:g}" for r in rs)
                             + ("" if col == "busy_cores" else " us/call"))
        for proc in ("server", "redis"):
            if proc not in rs[0]:
                continue
            keys = sorted({(comm, ev) for r in rs for comm, c in r[proc].get("per_call", {}).items() for ev in c})
            for comm, ev in keys:
                vals = [r[proc]["per_call"].get(comm, {}).get(ev, 0.0) for r in rs]
                lines.append(f"  {proc} {comm} {ev}: {median(vals):.2f} per call ({min(vals):.2f}-{max(vals):.2f})")
            for comm in sorted({c for r in rs for c, v in r[proc]["cpu_us"].items() if v["user"] + v["sys"] > 0}):
                u = ", ".join(f"{r[proc]['cpu_us'].get(comm, {}).get('user', 0):.0f}" for r in rs)
                k = ", ".join(f"{r[proc]['cpu_us'].get(comm, {}).get('sys', 0):.0f}" for r in rs)
                lines.append(f"  {proc} {comm} CPU us/call: user {u}; kernel {k}")
            for comm in sorted({c for r in rs for c in r[proc].get("waits", {})}):
                w = ", ".join(f"{r[proc]['waits'].get(comm, {}).get('wait', 0):.0f}" for r in rs)
                n = ", ".join(f"{r[proc]['waits'].get(comm, {}).get('turns', 0):.2f}" for r in rs)
                lines.append(f"  {proc} {comm} waiting for a CPU us/call: {w}; turns on a CPU per call {n}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.syscalls")
    ap.add_argument("--http", action="store_true", help="figure 2's door (the agent vs the raw ASGI echo)")
    ap.add_argument("--base", type=Path, help="another source tree whose agent is measured beside this one")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--calls", default=CALLS, help="system calls counted by name, comma-separated")
    ap.add_argument("--no-perf", action="store_true", help="CPU per thread only (no tracing)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasehold-syscalls-") as tmp:
        rows = run(Path(tmp), a.http, a.base.resolve() if a.base else None, a.rounds, a.seconds,
                   None if a.no_perf else a.calls)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
