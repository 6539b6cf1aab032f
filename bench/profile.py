"""Where a decision's Python CPU goes: profile the agent's engine in process (figure 3's loop)
with pyinstrument against a real redis-server, or an agent process over HTTP with py-spy when
it is installed.

    python -m bench.profile [--seconds 3] [--out bench-results/profile-engine.txt]
    python -m bench.profile --http [--seconds 3]   # py-spy on a running agent (figure 2 load)
    python -m bench.profile --rls [--native]       # py-spy on an agent's RLS port (figure 8's RLS load)
    python -m bench.profile --allocator            # py-spy on an allocator (figure 4 load)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from leasehold.local.procs import RedisServer

from .fig_library import CONCURRENCY, make_engine, user_requests
from .harness import drive, loadgen, services, start_agent


async def _engine_loop(redis_url: str, seconds: float) -> tuple[int, float]:
    engine, store = await make_engine(redis_url)
    reqs = user_requests(10_000, "prof")
    try:
        return await drive(lambda i: engine.admit(reqs[(i * 7919) % 10_000]), concurrency=CONCURRENCY,
                           duration_s=seconds, max_ops=5_000_000)
    finally:
        await store.close()


def profile_engine(work: Path, seconds: float) -> str:
    import uvloop
    from pyinstrument import Profiler

    redis = RedisServer(work / "profile-redis").start()
    with services(redis):
        prof = Profiler(interval=0.0005, async_mode="disabled")
        prof.start()
        done, secs = uvloop.run(_engine_loop(redis.url, seconds))
        prof.stop()
    head = f"engine in process, {CONCURRENCY} tasks: {done} decisions in {secs:.2f} s = {done / secs:,.0f}/s\n"
    return head + prof.output_text(unicode=False, color=False, show_all=False)


def _py_spy() -> str | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return spy if Path(spy).exists() else None


def _record_during(spy: str, pid: int, folded: Path, seconds: float, load: Callable[[], dict],
                   native: bool = False) -> dict:
    """py-spy samples ``pid`` (raw folded stacks into ``folded``) while ``load()`` runs; ``native``:
    C frames too, and every thread (grpcio's poller thread) — py-spy then pauses the process per sample."""
    extra = ["--native", "--threads", "--idle"] if native else ["--nonblocking"]
    rec = subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200",
                            "-f", "raw", "-o", str(folded), *extra],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        res = load()
        rec.wait(timeout=seconds + 30)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    return res


def profile_http(work: Path, seconds: float) -> str:
    spy = _py_spy()
    if spy is None:
        return "py-spy is not installed (pip install py-spy)"
    redis = RedisServer(work / "profile-redis").start()
    with services(redis):
        agent = start_agent(work / "profile-agent", redis.url)
        with services(agent):
            res = _record_during(spy, agent.proc.pid, work / "agent.folded", seconds, lambda: loadgen(
                {"port": agent.port, "path": "/v1/admit", "workload": "admit", "conns": 64,
                 "duration_s": seconds, "max_requests": 2_000_000}))
    return f"agent over HTTP, 64 conns: {res['rps']:,.0f} req/s\n" + summarise_folded(work / "agent.folded")


def profile_rls(work: Path, seconds: float, native: bool = False) -> str:
    """py-spy on an agent process under figure 8's RLS load: ``ShouldRateLimit`` on one gRPC channel,
    64 in flight, 10k users (``bench.gwload``)."""
    from leasehold.local.procs import free_port, wait_port

    from .fig_gateways import CONNS, gwload

    spy = _py_spy()
    if spy is None:
        return "py-spy is not installed (pip install py-spy)"
    redis = RedisServer(work / "profile-redis").start()
    with services(redis):
        rls_port = free_port()
        agent = start_agent(work / "profile-agent", redis.url, extra=["--rls-port", str(rls_port)])
        with services(agent):
            wait_port(rls_port, proc=agent.proc.popen, timeout=30)
            res = _record_during(spy, agent.proc.pid, work / "agent.folded", seconds, lambda: gwload(
                {"mode": "rls", "port": rls_port, "conns": CONNS, "duration_s": seconds, "principals": 10_000,
                 "tenant": "prof", "max_requests": 2_000_000}), native=native)
    return (f"agent over gRPC (RLS), {CONNS} in flight: {res['rps']:,.0f} calls/s, p50 {res['p50_ms']:.1f} ms\n"
            + summarise_folded(work / "agent.folded"))


def profile_allocator(work: Path, seconds: float) -> str:
    """py-spy on an allocator process under figure 4's load (64 grants per batch, 4 connections,
    1,000 pools, one etcd member)."""
    from leasehold.local.procs import EtcdCluster

    from .fig_alloc import BATCH, CONNS, many_pools_bundle, write_bundle
    from .harness import start_allocator

    spy = _py_spy()
    if spy is None:
        return "py-spy is not installed (pip install py-spy)"
    etcd = EtcdCluster(work / "profile-etcd", members=1).start()
    with services(etcd):
        policy = write_bundle(work / "profile-policy.json", many_pools_bundle(1_000))
        alloc = start_allocator(work / "profile-allocator", etcd, policy)
        with services(alloc):
            res = _record_during(spy, alloc.proc.pid, work / "allocator.folded", seconds, lambda: loadgen(
                {"port": alloc.port, "path": "/v1/leases/batch", "workload": "lease_batch",
                 "workload_args": {"pools": 1_000, "size": BATCH, "tag": "prof"}, "items_per_request": BATCH,
                 "conns": CONNS, "duration_s": seconds, "max_requests": 1_000_000, "count": '"granted":'}))
    return (f"allocator over HTTP, {CONNS} conns x {BATCH} grants per batch: {res['counted_per_s']:,.0f} grants/s\n"
            + summarise_folded(work / "allocator.folded"))


_LINE = re.compile(r":\d+\)$")


def summarise_folded(path: Path, top: int = 25) -> str:
    """Self and inclusive sample shares per function from py-spy's folded stacks."""
    if not path.exists():
        return "(no samples)"
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [_LINE.sub(")", f) for f in stack.split(";")]  # per function, not per line
        for f in set(frames):
            incl[f] = incl.get(f, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    lines = [f"{total} samples (py-spy; async callbacks start fresh stacks, so read self shares first)",
             "", "top by self share (inclusive):"]
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / total:5.1f}% ({100 * incl.get(f, 0) / total:5.1f}%)  {f}")
    lines += ["", "Leasehold code by inclusive share (self):"]
    ours = [(f, n) for f, n in incl.items() if "region_agent/" in f or "allocator/" in f]
    for f, n in sorted(ours, key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / total:5.1f}% ({100 * own.get(f, 0) / total:5.1f}%)  {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--http", action="store_true", help="py-spy on an agent process under figure 2's load")
    ap.add_argument("--allocator", action="store_true", help="py-spy on an allocator under figure 4's load")
    ap.add_argument("--rls", action="store_true", help="py-spy on an agent under figure 8's RLS load")
    ap.add_argument("--native", action="store_true", help="with --rls: native frames and every thread")
    ap.add_argument("--folded", type=Path, help="keep py-spy's folded stacks here")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.folded and not (a.http or a.rls or a.allocator):
        ap.error("--folded needs --http, --rls or --allocator (the engine's profile is pyinstrument's, not py-spy's)")
    with tempfile.TemporaryDirectory(prefix="leasehold-profile-") as tmp:
        if a.rls:
            text = profile_rls(Path(tmp), a.seconds, a.native)
        else:
            fn = profile_allocator if a.allocator else profile_http if a.http else profile_engine
            text = fn(Path(tmp), a.seconds)
        folded = Path(tmp) / ("allocator.folded" if a.allocator else "agent.folded")
        if a.folded and folded.exists():
            a.folded.write_text(folded.read_text())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
