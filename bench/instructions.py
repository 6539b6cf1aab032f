"""Instructions per decision under cachegrind, which a busy machine does not change.

Figure 3's engine in process against a real redis-server (outside valgrind): the Northstar
bundle, read-user-v3, 2,000 users, the node wired as the agent's store factory wires it (the
batch-size counter, the breaker gauge), 8 tasks. Each run is one Python process under
``valgrind --tool=cachegrind --cache-sim=no``: a warm-up of 4,000 decisions (every question
asked twice, so its plan is remembered), then ``--extra`` decisions more (0 in the first run).
Per decision = (instructions of the second run - the first's) / ``--extra``. Valgrind runs
Python about 10x slower, so the decision budget, the node's stall, late and connect limits are
5 s (thresholds only); every counted decision must be a store admission (``script``, 200), or the
pair is refused. Redis is flushed before each run; ``PYTHONHASHSEED`` is fixed; the start-up heap
is frozen before the warm-up, as the agent freezes it once started (otherwise every full
collection walks it, a cost the agent does not pay), and no decision is kept alive by the loop.

``--fresh``: every counted decision asks a question never asked before (figure 8's RLS trials,
a fresh tenant and 10,000 users cycled, are mostly such first asks): the warm-up as without it,
then users ``user-2000`` .. ``user-5999``, one counted decision each, so new keys, a new
principal hash, a new plan and (RLS) a call the door's memo does not know. Without it the
counted decisions ask the warm-up's questions again (every one remembered). ``engine``, ``rls``,
``rls-group`` and ``http`` alike.

``--door``: ``engine`` (``DecisionEngine.admit``), ``rls`` (``RateLimitServicer.ShouldRateLimit``
with the call's protobuf bytes, each call alone: the door's mapping, the admission, the decision,
the answer's bytes, the door's metrics), ``rls-group`` (the same calls decided in groups of
``GROUP``, as under figure 8's load: the door's ``CallGroup``, the admission's ``decide`` of the
group's questions, ``DecisionEngine.admit_many``, one pipeline per group; independent of timing:
one call is held entered for the whole run, so every call joins a group, and a group is released
when its ``GROUP``-th question arrives, never by the linger's timer; every group must have been
``GROUP`` calls, or the pair is refused) or ``http`` (the HTTP fast path's direct route without
the socket: ``DirectAdmit.answer`` on the body's bytes: the strict decode, the admission, the
decision, the JSON answer).

    python -m bench.instructions [--door engine|rls|rls-group|http] [--fresh] [--pairs 1] [--extra 4000] [--annotate DIR]
                                 [--group 8] [--cache-sim [--LL size,assoc,line]]
    python -m bench.instructions --cprofile FILE --redis-url redis://127.0.0.1:6379/0 [--door ...] [--fresh]

``--annotate DIR`` keeps both runs' ``cachegrind.out`` files there (``cg_diff`` of the two, then
``cg_annotate`` of that, shows per C function where the extra decisions' instructions go; one
pair differs from the next by about 1 % of a decision, so compare medians of several pairs).
``--cache-sim`` has cachegrind simulate this host's caches too and reports per decision the data
references (``D``) and the misses of the first level (``D1``, ``I1``) and of the last level simulated
(``LLd``, ``LLi``; by default the core's 512 KiB L2, whose misses leave the core; ``--LL
33554432,16,64`` for the shared 32 MiB L3). A simulation of one process alone: what the other
processes on the same cores evict between its turns is not in it. ``--group N``: the grouped door's
calls per group (default ``GROUP``).
``--cprofile`` runs once without valgrind and profiles only the counted decisions (the Python
functions and their call counts per decision)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from leasehold.local.procs import RedisServer

from .harness import services

USERS = 2_000
WARMUP = 2 * USERS
TASKS = 8
GROUP = TASKS  # --door rls-group: calls per group (every task's call waits in the group until it is full)
DOORS = ("engine", "rls", "rls-group", "http")
LIMIT_S = 5.0  # the decision budget and the node's stall and late limits under valgrind
_IREFS = re.compile(r"I\s+refs:\s+([\d,]+)")
# --cache-sim: cachegrind's summary lines counted per decision (instruction fetches and their misses,
# data reads and writes and their misses in the first level and the last level simulated)
CACHE_EVENTS = {"I1 misses": "I1", "LLi misses": "LLi", "D refs": "D", "D1 misses": "D1", "LLd misses": "LLd"}
_EVENT = re.compile(r"(I1|LLi|D|D1|LLd)\s+(?:misses|refs):\s+([\d,]+)")
# this host's caches (AMD EPYC, Zen 3, per core): L1d and L1i 32 KiB 8-way, L2 512 KiB 8-way (the last
# level cachegrind simulates by default here: a miss in it leaves the core); L3 32 MiB 16-way, shared
HOST_CACHES = {"D1": "32768,8,64", "I1": "32768,8,64", "LL": "524288,8,64"}


def user_of(i: int, fresh: bool) -> int:
    """The user the ``i``-th decision asks for: the warm-up's 2,000 users in turn, then (``fresh``)
    a user never asked before for every counted decision."""
    if fresh and i >= WARMUP:
        return USERS + i - WARMUP
    return i % USERS


async def _child(redis_url: str, door: str, extra: int, check: int, cprofile: Path | None = None,
                 fresh: bool = False, group: int = GROUP) -> dict:
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2
    from prometheus_client import CollectorRegistry

    from leasehold.local.topology import DEV_PEPPER
    from region_agent.decision.admission import Admission
    from region_agent.decision.engine import DecisionEngine
    from region_agent.decision.keys import KeyBuilder
    from region_agent.gateways.mapping import Names
    from region_agent.gateways.metrics import GatewayMetrics
    from region_agent.gateways.rls import RateLimitServicer
    from region_agent.models import AdmitRequest, Principal
    from region_agent.service.fastpath import DirectAdmit
    from region_agent.service.metrics import AgentMetrics
    from region_agent.service.policy import PolicyHolder
    from region_agent.store import scripts as sc
    from region_agent.store.breaker import CircuitBreaker
    from region_agent.store.client import make_client
    from region_agent.store.node import RedisNode

    from .harness import NORTHSTAR, drive

    m = AgentMetrics()
    holder = PolicyHolder.load(str(NORTHSTAR))
    batches: list[int] = []

    def on_batch(n: int) -> None:
        batches.append(n)
        m.batch_sizes.observe(n)

    gauge = m.breaker_state.labels("default")
    client = make_client(redis_url, max_connections=32, socket_timeout=LIMIT_S)
    client.connection_pool.connection_kwargs["socket_connect_timeout"] = LIMIT_S  # (a threshold, as the others)
    store = RedisNode(client, sc.Scripts(),
                      on_batch=on_batch, breaker=CircuitBreaker(), on_breaker=gauge.set,
                      stall_s=LIMIT_S, late_s=LIMIT_S, connect_timeout_s=LIMIT_S)
    await store.load()
    engine = DecisionEngine(get_snapshot=lambda: holder.snapshot, keys=KeyBuilder(DEV_PEPPER.encode()), store=store,
                            metrics=m, budget_ms=int(LIMIT_S * 1000))
    st = type("State", (), {})()
    st.engine, st.holder, st.policy_watch, st.version_check, st.key_cap, st.auth = engine, holder, None, None, None, None
    st.metrics = m
    st.admission = admission = Admission(lambda: st)
    tenant = "scale"
    decisions: list = []
    groups: list[int] = []  # --door rls-group: the calls of each group decided
    if door == "engine":
        reqs = [AdmitRequest(request_id=f"i-{i // USERS}-{i % USERS:06d}",
                             principal=Principal(type="user", id=f"user-{user_of(i, fresh)}"),
                             route_group="read", tenant_id=tenant) for i in range(WARMUP + 2 * USERS)]

        async def op(i: int) -> None:
            d = await engine.admit(reqs[i])
            decisions.append((d.source.value, d.http_status))  # (no decision kept alive: the collector's work)
    elif door in ("rls", "rls-group"):
        D = ratelimit_pb2.RateLimitDescriptor
        raw = [rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
            D.Entry(key="tenant", value=tenant), D.Entry(key="user", value=f"user-{i}"),
            D.Entry(key="route_group", value="read")])]).SerializeToString() for i in range(3 * USERS)]
        servicer = RateLimitServicer(names=Names.build(), decide=admission.decide, decide_one=admission.decide_one,
                                     snapshot_of=lambda: holder.snapshot,
                                     gateways=None, metrics=GatewayMetrics(CollectorRegistry()),
                                     group_linger_s=LIMIT_S if door == "rls-group" else 0.0, group_size=group)
        if door == "rls-group":
            # the group's count of calls recorded; one call entered for the whole run, so every counted
            # call has another in flight and joins a group (released by its GROUP-th question; the
            # linger's timer is a fallback the check below refuses)
            observe = servicer.group._on_group

            def on_group(n: int) -> None:
                groups.append(n)
                if observe is not None:
                    observe(n)

            servicer.group._on_group = on_group
            servicer.group.enter()

        class _Ctx:
            def invocation_metadata(self):
                return ()

        ctx = _Ctx()

        async def op(i: int) -> None:
            decisions.append(await servicer.ShouldRateLimit(raw[user_of(i, fresh)], ctx))
    else:
        bodies = [json.dumps({"requestId": f"h-{i // USERS}-{i % USERS:06d}",
                              "principal": {"type": "user", "id": f"user-{user_of(i, fresh)}"},
                              "routeGroup": "read", "tenantId": tenant}).encode()
                  for i in range(WARMUP + 2 * USERS)]
        direct = DirectAdmit(lambda: st, 1 << 20, "/v1/admit")

        heads = [[(b"content-type", b"application/json"), (b"content-length", str(len(b)).encode())]
                 for b in bodies]

        async def op(i: int) -> None:
            headers = heads[i]
            if not direct.admits(headers):
                raise AssertionError("the direct route refused the request")
            answered = direct.answer(headers, bodies[i])
            if answered is None:
                raise AssertionError("the direct route handed the request over")
            status, _headers, payload = await answered
            decisions.append((status, payload))

    gc.collect()
    gc.freeze()  # as the agent does once it has started (kernel.httpserver.freeze_startup_heap)
    try:
        done, _ = await drive(op, concurrency=TASKS, duration_s=1e9, max_ops=WARMUP)
        prof = None
        if cprofile is not None:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        done += (await drive(lambda i: op(WARMUP + i), concurrency=TASKS, duration_s=1e9, max_ops=extra))[0]
        if prof is not None:
            prof.disable()
            prof.dump_stats(str(cprofile))
        assert done == WARMUP + extra, (done, extra)
    finally:
        await store.close()
    # the last ``check`` decisions are looked at, in both runs of a pair (the same work in each)
    counted = decisions[len(decisions) - check:]
    if door == "engine":
        kinds = sorted(set(counted))
    elif door in ("rls", "rls-group"):
        kinds = sorted({("rls", int(rls_pb2.RateLimitResponse.FromString(b).overall_code)) for b in counted})
    else:
        kinds = sorted({(json.loads(p).get("source"), s) for s, p in counted})
    return {"kinds": [list(k) for k in kinds], "pipelines": len(batches),
            "calls": sum(batches), "decisions": len(decisions),
            "groups": len(groups), "grouped": sum(groups), "whole": all(n == group for n in groups)}


def _flush(redis_url: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        r.flushall()
    finally:
        r.close()


def cache_counts(stderr: str) -> dict[str, int]:
    """Cachegrind's ``--cache-sim=yes`` summary: instruction refs and the cache events of
    ``CACHE_EVENTS`` by their short name (the last value of each, the main process's)."""
    found = {"I": int(_IREFS.findall(stderr)[-1].replace(",", ""))}
    for name, value in _EVENT.findall(stderr):
        found[name] = int(value.replace(",", ""))
    return found


def _valgrind_run(redis_url: str, door: str, extra: int, check: int, out: Path,
                  fresh: bool = False, caches: dict[str, str] | None = None, group: int = GROUP) -> tuple[dict[str, int], dict]:
    """One child under cachegrind: its counts (``I``, the instructions; with ``caches``, the
    simulation's misses too) and its own report."""
    _flush(redis_url)
    env = dict(os.environ, PYTHONHASHSEED="0")
    sim = ["--cache-sim=no"] if caches is None else ["--cache-sim=yes", *(f"--{k}={v}" for k, v in caches.items())]
    cmd = ["valgrind", "--tool=cachegrind", *sim, f"--cachegrind-out-file={out}",
           sys.executable, "-m", "bench.instructions", "--child", redis_url, "--door", door, "--extra", str(extra),
           "--check", str(check), "--group", str(group), *(["--fresh"] if fresh else [])]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3_600)
    found = _IREFS.findall(p.stderr)
    if p.returncode != 0 or not found:
        raise RuntimeError(f"valgrind run failed ({p.returncode}): {p.stderr[-2000:]}")
    info = json.loads(p.stdout.strip().splitlines()[-1])
    return cache_counts(p.stderr), info


def _expected(door: str) -> list[list]:
    return {"engine": [["script", 200]], "rls": [["rls", 1]], "rls-group": [["rls", 1]], "http": [["script", 200]]}[door]


def _refusal(door: str, info0: dict, info1: dict, extra: int, group: int = GROUP) -> str:
    """Why a pair does not count ('' when it does)."""
    if info1["kinds"] != _expected(door):
        return "not every counted decision was a store admission"
    if door == "rls-group" and not (info0["whole"] and info1["whole"]
                                    and info1["grouped"] - info0["grouped"] == extra):
        return f"not every counted call was decided in a group of {group}"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions")
    ap.add_argument("--door", choices=DOORS, default="engine")
    ap.add_argument("--pairs", type=int, default=1, help="pairs of runs (warm-up alone, warm-up + extra)")
    ap.add_argument("--extra", type=int, default=WARMUP, help="decisions counted after the warm-up (<= 4,000)")
    ap.add_argument("--fresh", action="store_true", help="every counted decision asks a question never asked before")
    ap.add_argument("--annotate", type=Path, help="keep the cachegrind.out files here")
    ap.add_argument("--cache-sim", action="store_true", help="simulate this host's caches too (L1 32 KiB, "
                    "last level the core's 512 KiB L2 unless --LL): misses per decision")
    ap.add_argument("--LL", default=HOST_CACHES["LL"], help="with --cache-sim: the last level simulated, "
                    "size,associativity,line (e.g. 33554432,16,64 for this host's shared L3)")
    ap.add_argument("--cprofile", type=Path, help="no valgrind: one run in process, cProfile of the counted "
                    "decisions written to this file (call counts per decision; needs a --redis-url)")
    ap.add_argument("--redis-url", help="with --cprofile: a redis-server to use (flushed first)")
    ap.add_argument("--group", type=int, default=GROUP, help="--door rls-group: calls per group (figure 8's "
                    "groups follow the arrival rate over the 2 ms linger: about 7 on a host twice as fast as one "
                    "with about 3.5)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--check", type=int, default=WARMUP, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.child and not 1 <= a.extra <= 2 * USERS:
        ap.error("--extra must be within 1..4000 (each question is new: 4 askings of 2,000 users)")
    if not 2 <= a.group <= TASKS:
        ap.error(f"--group must be within 2..{TASKS} (the tasks that fill a group)")
    if a.door == "rls-group" and (a.extra % a.group or WARMUP % a.group):
        ap.error(f"--door rls-group: --extra must be a multiple of --group {a.group} (whole groups)")
    if a.child:
        import uvloop

        print(json.dumps(uvloop.run(_child(a.child, a.door, a.extra, a.check, fresh=a.fresh, group=a.group))))
        return 0
    if a.cprofile:
        import uvloop

        if not a.redis_url:
            ap.error("--cprofile needs --redis-url")
        _flush(a.redis_url)
        print(json.dumps(uvloop.run(_child(a.redis_url, a.door, a.extra, a.extra, a.cprofile, fresh=a.fresh,
                                           group=a.group))))
        return 0
    with tempfile.TemporaryDirectory(prefix="leasehold-instructions-") as tmp:
        keep = a.annotate or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        redis = RedisServer(Path(tmp) / "redis").start()
        caches = dict(HOST_CACHES, LL=a.LL) if a.cache_sim else None
        with services(redis):
            for n in range(a.pairs):
                c0, info0 = _valgrind_run(redis.url, a.door, 0, a.extra, keep / f"cachegrind.out.{a.door}.{n}.warmup",
                                          a.fresh, caches, a.group)
                c1, info1 = _valgrind_run(redis.url, a.door, a.extra, a.extra, keep / f"cachegrind.out.{a.door}.{n}.extra",
                                          a.fresh, caches, a.group)
                base, more = c0["I"], c1["I"]
                refused = _refusal(a.door, info0, info1, a.extra, a.group)
                misses = "".join(f" ; {k} {(c1[k] - c0[k]) / a.extra:,.1f}" for k in ("D", "D1", "LLd", "I1", "LLi")
                                 if k in c0 and k in c1)
                label = f"{a.door}{f' group {a.group}' if a.door == 'rls-group' else ''}{' fresh' if a.fresh else ''}"
                print(f"{label} pair {n + 1}: warm-up {base:,} ; + {a.extra:,} decisions {more:,} ; "
                      f"per decision {(more - base) / a.extra:,.0f}{misses}"
                      f"{f' (REFUSED: {refused})' if refused else ''} ; "
                      f"counted {info1['kinds']}, pipelines {info1['pipelines'] - info0['pipelines']} "
                      f"of {info1['calls'] - info0['calls']} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
