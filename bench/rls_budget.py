"""What the RLS door may spend per call: figure 8's ceiling (a bare ``grpc.aio`` server answering a
constant ``OK``) made to do what the agent's door does around a decision, with the decision
replaced by a stated amount of Python per call — so that the agent's own ratio to the bare server
can be read as "the agent spends as if each call cost W us", and the goal (0.85) as a budget.

A model server (``serve``) is the bare server plus the agent's shape: every call enters the agent's
own :class:`region_agent.gateways.call_group.CallGroup` (a call that arrives while others are in
flight waits up to the same 2 ms for others, at most 32 at a time, and the group is decided at
once), and deciding a group of ``n`` calls burns ``n x W`` microseconds of Python on the event
loop's thread and awaits one loop turn (where the agent awaits its Redis pipeline). ``W`` holds
everything the agent does per call beyond gRPC's own work: the descriptor mapping, the admission
and the engine, the Redis pipeline's share, the protobuf answer, the metrics.

The server model is the agent's (``--models aio``: ``grpc.aio`` in the decisions' own event loop)
or one of two in which gRPC's own work and the decisions run on different threads, which could
overlap on two cores (decision 0027 left them to be measured end to end):

* ``thread`` — ``grpc.aio`` on a thread and event loop of its own, each group handed to the main
  thread's loop (``run_coroutine_threadsafe``) and its answers handed back;
* ``sync`` — grpcio's synchronous server, each call's handler thread (a pool of ``SYNC_THREADS``)
  handing its call to the main thread's loop, where the calls are grouped, and blocking on it.

The driver starts the bare server, one model server per ``--work-us`` value and model and, unless ``--no-agent``, a real agent on a real redis-server, and
loads each with figure 8's RLS load generator (one channel, 64 calls in flight, 10k users),
alternated in the same minutes, ``--rounds`` times; per server: calls/s, its ratio to the bare
server of the same round, p50 against the bare p50, and the server's CPU per call.

    python -m bench.rls_budget [--work-us 0,30,60,90] [--models aio,thread,sync] [--no-agent] [--rounds 3] [--seconds 4]
    python -m bench.rls_budget serve --port N --work-us W [--model aio|thread|sync]    # one model server

Every process is a real one on a free loopback port, stopped by PID."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from .stats import median

LINGER_S = 0.002  # the agent's --rls-group-linger-ms default
GROUP_SIZE = 32  # the agent's group size (its batcher's pipeline size)
SYNC_THREADS = 64  # the synchronous server's handler threads: one per call in flight (figure 8: 64)
MODELS = ("aio", "thread", "sync")


def parse_work(text: str) -> list[float]:
    """``"0,30,60"`` -> ``[0.0, 30.0, 60.0]``: microseconds of Python per call, each >= 0."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--work-us: comma-separated microseconds, got {text!r}") from None
    if not out or any(x < 0 or x != x for x in out):
        raise argparse.ArgumentTypeError(f"--work-us: one or more values >= 0, got {text!r}")
    return out


def parse_models(text: str) -> list[str]:
    """``"aio,sync"`` -> ``["aio", "sync"]``; each one of :data:`MODELS`."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in MODELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"--models: comma-separated, each one of {', '.join(MODELS)}; got {text!r}")
    return out


def burn(us: float) -> None:
    """Hold the thread (and the GIL) for ``us`` microseconds of Python on the CPU, as a decision's
    code does: the thread's own CPU time, so a busy machine that preempts it stretches the wall time
    as it would the agent's, never shortens the work."""
    end = time.thread_time() + us / 1e6
    while time.thread_time() < end:
        pass


def group_decider(work_us: float) -> Callable[[list], Coroutine[Any, Any, list]]:
    """A group's decision: ``len(questions) x work_us`` of Python, then one loop turn (the
    agent's Redis pipeline is awaited there)."""
    async def decide(questions: list) -> list:
        burn(work_us * len(questions))
        await asyncio.sleep(0)
        return [None] * len(questions)
    return decide


def on_loop(loop: asyncio.AbstractEventLoop,
            decide: Callable[[list], Coroutine[Any, Any, list]]) -> Callable[[list], Awaitable[list]]:
    """``decide`` run on another thread's ``loop``, awaited from this one."""
    def handed_over(questions: list) -> Awaitable[list]:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(decide(questions), loop))
    return handed_over


def grouped(decide: Callable[[list], Awaitable[list]]) -> Callable[[list], Coroutine[Any, Any, list]]:
    """One call's questions through the agent's call groups in front of ``decide`` (as the RLS
    servicer: a call that arrives while others are in flight joins a group)."""
    from region_agent.gateways.call_group import CallGroup

    group = CallGroup(decide, LINGER_S, GROUP_SIZE)

    async def call(questions: list) -> list:
        joins = group.enter()
        try:
            return await (group.decide(questions) if joins else decide(questions))
        finally:
            group.leave()
    return call


async def serve(port: int, call: Callable[[list], Awaitable[list]]) -> None:
    """A bare grpc.aio server whose every call awaits ``call`` with one question (its content is
    not looked at) before answering ``OK``."""
    import grpc
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    ok = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)

    class Servicer(rls_pb2_grpc.RateLimitServiceServicer):
        async def ShouldRateLimit(self, request, context):  # noqa: N802 (the generated name)
            await call([request.domain])
            return ok

    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, call: Callable[[list], Coroutine[Any, Any, list]], loop: asyncio.AbstractEventLoop) -> Any:
    """grpcio's synchronous server; each handler thread runs ``call`` on ``loop`` and waits for it."""
    from concurrent import futures

    import grpc
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    ok = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)

    class Servicer(rls_pb2_grpc.RateLimitServiceServicer):
        def ShouldRateLimit(self, request, context):  # noqa: N802 (the generated name)
            asyncio.run_coroutine_threadsafe(call([request.domain]), loop).result(timeout=30)
            return ok

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=SYNC_THREADS), maximum_concurrent_rpcs=None)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def run_server(port: int, work_us: float, model: str) -> None:
    import uvloop

    decide = group_decider(work_us)
    if model == "aio":  # the agent's model: gRPC and the decisions in one loop
        uvloop.run(serve(port, grouped(decide)))
        return
    main_loop = uvloop.new_event_loop()  # the decisions' loop, on this (the main) thread
    if model == "thread":  # the calls grouped on gRPC's loop, each group decided on the main loop
        threading.Thread(target=uvloop.run, args=(serve(port, grouped(on_loop(main_loop, decide))),),
                         name="grpc-loop", daemon=True).start()
    else:  # sync: each call handed to the main loop, grouped there
        asyncio.set_event_loop(main_loop)
        server = serve_sync(port, grouped(decide), main_loop)
        try:
            main_loop.run_forever()
        finally:
            server.stop(0)
        return
    main_loop.run_forever()


def _servers(work_values: list[float], models: list[str]) -> list[tuple[str, list[str]]]:
    """(name, ``serve`` arguments) of each model server: one per work value and model."""
    return [(f"w{w:g}" if m == "aio" else f"w{w:g}-{m}", ["--work-us", f"{w:g}", "--model", m])
            for w in work_values for m in models]


def ratios(res: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
    """Per server, medians over the rounds: calls/s, the ratio to the bare server of the same
    round, p50 over the bare p50, CPU per call."""
    out: dict[str, dict[str, Any]] = {}
    bare = res["bare"]
    for name, xs in res.items():
        per_round = [x["rps"] / b["rps"] for x, b in zip(xs, bare, strict=True) if b["rps"]]
        p50s = [x["p50_ms"] / b["p50_ms"] for x, b in zip(xs, bare, strict=True) if b["p50_ms"]]
        cpus = [x["cpu_us"] for x in xs if x.get("cpu_us") is not None]
        out[name] = {"rps": median(x["rps"] for x in xs), "ratio": median(per_round) if per_round else None,
                     "p50_x": median(p50s) if p50s else None, "cpu_us": median(cpus) if cpus else None,
                     "ratios": per_round}
    return out


def run(work: Path, work_values: list[float], models: list[str], agent: bool, rounds: int, seconds: float) -> dict:
    from leasehold.local.procs import RedisServer

    from .fig_gateways import CONNS, gwload
    from .harness import CpuMeter
    from .rls_ab import _agent
    from .rls_models import _bare

    redis = RedisServer(work / "redis").start() if agent else None
    procs: list = []
    servers: dict[str, tuple[int, int]] = {}
    try:
        bare, port = _bare(work, "bare")
        procs.append(bare)
        servers["bare"] = (port, bare.pid)
        for name, args in _servers(work_values, models):
            p, port = _bare(work, name, *args, module="bench.rls_budget serve")
            procs.append(p)
            servers[name] = (port, p.pid)
        if redis is not None:
            a, port = _agent(work, redis.url, "agent", None, [])
            procs.append(a)
            servers["agent"] = (port, a.proc.pid)
        res: dict[str, list[dict]] = {k: [] for k in servers}
        for t in range(rounds):
            for name in (list(servers) if t % 2 == 0 else list(reversed(servers))):
                port, pid = servers[name]
                with CpuMeter({"server": pid}) as m:
                    out = gwload({"mode": "rls", "port": port, "conns": CONNS, "duration_s": seconds,
                                  "warmup_s": 0.5, "principals": 10_000, "tenant": f"budget{t}",
                                  "max_requests": 2_000_000})
                res[name].append({"rps": out["rps"], "p50_ms": out["p50_ms"], "p99_ms": out["p99_ms"],
                                  "cpu_us": m.per(out["sent"]).get("server"), "machine_cores": m.machine_cores})
    finally:
        for p in reversed(procs):
            p.stop()
        if redis is not None:
            redis.stop()
    return {"trials": res, "medians": ratios(res)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        sp = argparse.ArgumentParser(prog="python -m bench.rls_budget serve")
        sp.add_argument("--port", type=int, required=True)
        sp.add_argument("--work-us", type=float, default=0.0)
        sp.add_argument("--model", choices=MODELS, default="aio")
        s = sp.parse_args(argv[1:])
        if s.work_us < 0:
            sp.error("--work-us must be >= 0")
        run_server(s.port, s.work_us, s.model)
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.rls_budget")
    ap.add_argument("--work-us", type=parse_work, default=[0.0, 30.0, 60.0, 90.0],
                    help="microseconds of Python per call, comma-separated (default 0,30,60,90)")
    ap.add_argument("--models", type=parse_models, default=["aio"],
                    help=f"server models, comma-separated, of {', '.join(MODELS)} (default aio: the agent's)")
    ap.add_argument("--no-agent", action="store_true", help="without the real agent (and its Redis)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leasehold-rls-budget-") as tmp:
        out = run(Path(tmp), a.work_us, a.models, not a.no_agent, a.rounds, a.seconds)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    for name, m in out["medians"].items():
        per_round = ", ".join(f"{r:.2f}" for r in m["ratios"])
        print(f"{name:10s} {m['rps']:8,.0f} calls/s  ratio {m['ratio']:.3f} ({per_round})  "
              f"p50 x{m['p50_x']:.2f}  CPU {m['cpu_us'] or 0:5.0f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
