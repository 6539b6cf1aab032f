"""Figure "redis": what one ``redis-server`` sustains with Leasehold's own scripts, and what a key
costs in memory — the measured inputs of the Redis capacity plan (docs/capacity.md, section 6;
``leasehold capacity``).

**Script executions per second.** Every script of ``lua/`` (and ``multi_rule.lua`` at 1, 3 and 5
rules, its slots built by the agent's own code) runs by EVALSHA from ``redis-benchmark`` against one
fresh redis-server: 16 connections, pipelines of 32 (the agent's ``--batch-max``; a fleet of agents
keeps several such pipelines in flight), random keys over 100,000 (each ``__rand_int__`` of a
call drawn on its own), state prepared where a script needs some (a lease to take from, a slot to
release). Measured per script: calls/s sustained, the server's own time per call (``INFO
commandstats``: inside the script) and the redis-server process's CPU per call (``INFO cpu``:
the script, the protocol and the socket I/O) — ``1e6 / CPU per call`` is what one redis-server
sustains on a core of its own, the figure the capacity plan uses (on these shared 2-core
machines redis-server does not get a whole core: the calls/s measured here are lower and noisier).
A run whose scripts answered errors is refused (every call must be a real execution). Each
trial sends about 2.5 s of calls (1 s with ``--quick``), sized from a short calibration run.

**Bytes per key.** For each algorithm, 1,000,000 keys (100,000 with ``--quick``) written by its
own script's code (its expanded source wrapped in a loop over keys, 2,000 keys per EVAL) with keys
shaped like the agent's (``rl:v3:{t:<tenant>}:u:<16 hex>:read``; the expiry set by the script as
always, long enough to outlive the measurement): ``(used_memory after - before) / keys``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from kernel.bundle import load_bundle_file
from leasehold.local.procs import LOOPBACK, RedisServer
from region_agent.decision.call import Call, multi_rule_argv, script_for
from region_agent.store import scripts as sc

from .context import Ctx
from .harness import NORTHSTAR, machine_busy, redis_client, redis_cpu, services, used_memory
from .stats import Row, median

FIGURE = "redis"
CLIENTS, PIPELINE = 16, 32
KEYSPACE = 100_000
MEMORY_KEYS, MEMORY_KEYS_QUICK = 1_000_000, 100_000
RAND = "__rand_int__"
SLACK = 5_000  # ttl_slack_ms, as the bundles' default


@dataclass
class Workload:
    """One script call shape for redis-benchmark (``__rand_int__`` in keys/ARGV: a random 12-digit number)."""

    name: str  # the row's name: the script, and its variant
    script: str
    keys: list[str]
    argv: list[str]
    setup: Callable[[redis.Redis, sc.Scripts, int], None] | None = None  # (client, scripts, keyspace)
    extra: dict = field(default_factory=dict)


def _bench_key(i: int | str, kind: str = "u") -> str:
    tag = i if isinstance(i, str) else f"{i:012d}"
    return f"rl:v3:{{t:{tag}}}:{kind}:0123456789abcdef:read"


def _now_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def _prepare_pools(r: redis.Redis, scripts: sc.Scripts, keyspace: int) -> None:
    """A large lease in every pool key of the keyspace (what pool_take / pool_balance read)."""
    now = _now_ms(r)
    populate(r, scripts, "pool_deposit", _bench_key_lua("pool"), keyspace,
             ["bench-lease", str(10**12), str(now - 1_000), str(now + 3_600_000), "16", str(SLACK)])


def _prepare_slots(r: redis.Redis, scripts: sc.Scripts, keyspace: int) -> None:
    """A concurrency gate holding lease "L" in every key (what release / renew find)."""
    populate(r, scripts, "concurrency_acquire", _bench_key_lua("cc"), keyspace, ["L", "1000", "3600000"])


def _bench_key_lua(kind: str) -> str:
    """:func:`_bench_key` of key number ``i`` as a Lua expression (what redis-benchmark's ``__rand_int__`` gives)."""
    return f"string.format('rl:v3:{{t:%012d}}:{kind}:0123456789abcdef:read', i)"


def multi_rule_workload(n: int) -> Workload:
    """The multi-rule call of ``n`` rules as the agent builds it (region_agent.decision.call): Northstar's
    P-READ user bucket and Atlas's tenant bucket first, then a fixed window, a sliding-window
    counter and a GCRA bucket; the decision record off (cheap reads carry none)."""
    from kernel.algorithms import make_rule

    northstar = {r.id: r for r in load_bundle_file(str(NORTHSTAR)).rules}
    more = [make_rule(algorithm="fixed_window", id="fw", scope="user", fail_mode="open", limit=100, window_ms=10_000),
            make_rule(algorithm="sliding_counter", id="sc", scope="user", fail_mode="open", limit=1_000,
                      window_ms=60_000),
            make_rule(algorithm="gcra", id="gcra", scope="user", fail_mode="open", capacity_millis=50_000,
                      refill_millis=10_000, period_ms=1_000, cost_millis=1_000)]
    rules = [northstar["read-user-v3"], northstar["tenant-atlas-minute"], *more][:n]
    kinds = ["u", "tenant", "fw", "sc", "gcra"]
    calls = [Call(_bench_key(RAND, kinds[i]), r.kind.code, r.script_params(1)) for i, r in enumerate(rules)]
    keys, argv = multi_rule_argv(_bench_key(RAND, "d"), calls, slack_ms=SLACK, decision_ttl_ms=0,
                                 member=f"req-{RAND}")
    # the script the agent runs for these slots: multi_rule.lua's lean variant for their kinds
    return Workload(f"multi_rule ({n} rule{'s' if n > 1 else ''})", script_for(tuple(c.kind for c in calls)), keys,
                    [str(a) for a in argv],
                    extra={"rules": [r.id for r in rules]})


def hot_chunk_workload() -> Workload:
    """A hot key set's chunk take as region_agent.leasing.hot_chunks sends it: the two rules of
    the two-rule multi-rule call (Northstar's P-READ user bucket, Atlas's tenant bucket), up to
    100 units at once (the script searches down from 100 to what both rules allow)."""
    northstar = {r.id: r for r in load_bundle_file(str(NORTHSTAR)).rules}
    rules = [northstar["read-user-v3"], northstar["tenant-atlas-minute"]]
    calls = [Call(_bench_key(RAND, kind), r.kind.code, r.script_params(1)) for kind, r in zip(("u", "tenant"), rules,
                                                                                            strict=True)]
    _, argv = multi_rule_argv(_bench_key(RAND, "d"), calls, slack_ms=SLACK, decision_ttl_ms=0, member="-")
    unit = argv[3:-1]  # each rule's kind and parameters for one unit (region_agent.decision.hot)
    return Workload("hot_chunk (2 rules, up to 100 units)", script_for(tuple(c.kind for c in calls), "hot_chunk"),
                    [c.key for c in calls],
                    [str(a) for a in (SLACK, f"chunk-{RAND}", 1, 100, *unit)])


def approx_reconcile_workload() -> Workload:
    """One agent's reconciliation of an approximate counter (region_agent.decision.approx): a delta of
    5 units for the current 10 s window (the window of the moment the workload is built)."""
    window_ms = 10_000
    index = int(time.time() * 1000) // window_ms
    return Workload("approx_reconcile (one delta)", "approx_reconcile", [_bench_key(RAND, "approx")],
                    [str(window_ms), str(SLACK), str(index), "5"])


def workloads() -> list[Workload]:
    k = _bench_key(RAND)
    return [
        multi_rule_workload(1), multi_rule_workload(3), multi_rule_workload(5),
        hot_chunk_workload(), approx_reconcile_workload(),
        Workload("token_bucket", "token_bucket", [k], ["20000", "10000", "1000", "1000", str(SLACK)]),
        Workload("gcra", "gcra", [k], ["20000", "10000", "1000", "1000", str(SLACK)]),
        Workload("fixed_window", "fixed_window", [k], ["100", "10000", "1", str(SLACK)]),
        Workload("sliding_counter", "sliding_counter", [k], ["100", "10000", "1", str(SLACK)]),
        Workload("sliding_log", "sliding_log", [k], ["100", "10000", f"m-{RAND}", "1", str(SLACK)]),
        Workload("concurrency_acquire", "concurrency_acquire", [_bench_key(RAND, "cc")], [f"L-{RAND}", "10", "30000"]),
        Workload("concurrency_renew (slot held)", "concurrency_renew", [_bench_key(RAND, "cc")], ["L", "3600000"],
                 setup=_prepare_slots),
        Workload("concurrency_release (slot held, then absent)", "concurrency_release", [_bench_key(RAND, "cc")],
                 ["L"], setup=_prepare_slots),
        Workload("pool_take (a lease to take from)", "pool_take", [_bench_key(RAND, "pool")], ["1", "20", str(SLACK)],
                 setup=_prepare_pools),
        Workload("pool_balance (one lease)", "pool_balance", [_bench_key(RAND, "pool")], [], setup=_prepare_pools),
        Workload("pool_deposit", "pool_deposit", [_bench_key(RAND, "pool")],
                 [f"lease-{RAND}", "100", "0", "9999999999999", "16", str(SLACK)]),
        # a refund id is recorded once: a later call of the same key (redis-benchmark's keyspace) is
        # answered as a replay, as a retried refund is
        Workload("pool_refund (a lease to refund to; a repeated id is a replay)", "pool_refund",
                 [_bench_key(RAND, "pool"), _bench_key(RAND, "refund")], ["1", str(SLACK), "bench-lease", "1"],
                 setup=_prepare_pools),
        Workload("pool_close (lease absent)", "pool_close", [_bench_key(RAND, "pool")], [f"lease-{RAND}"],
                 setup=_prepare_pools),
    ]


# ------------------------------------------------------------------------------- throughput
def _commandstats(r: redis.Redis) -> tuple[int, int, int]:
    """(calls, usec, failed + rejected calls) of EVALSHA so far."""
    st = r.info("commandstats").get("cmdstat_evalsha", {})
    return int(st.get("calls", 0)), int(st.get("usec", 0)), int(st.get("failed_calls", 0)) + int(st.get("rejected_calls", 0))


def benchmark(server: RedisServer, w: Workload, requests: int, sha: str) -> dict:
    """One redis-benchmark run of ``w``: rps, server and process CPU per call, the machine's load."""
    r = redis_client(server)
    try:
        c0, u0, f0 = _commandstats(r)
        cpu0, busy0 = redis_cpu(r), machine_busy()[0]
        t0 = time.perf_counter()
        out = subprocess.run(["redis-benchmark", "-h", LOOPBACK, "-p", str(server.port), "-c", str(CLIENTS),
                              "-P", str(PIPELINE), "-n", str(requests), "-r", str(KEYSPACE), "--csv",
                              "EVALSHA", sha, str(len(w.keys)), *w.keys, *w.argv],
                             capture_output=True, text=True, timeout=300, check=True)
        wall = time.perf_counter() - t0
        c1, u1, f1 = _commandstats(r)
        cpu1, busy1 = redis_cpu(r), machine_busy()[0]
    finally:
        r.close()
    calls = c1 - c0
    if f1 - f0:
        raise RuntimeError(f"{w.name}: {f1 - f0} of {calls} script calls failed (bad arguments for the script?)")
    last = [ln for ln in out.stdout.splitlines() if ln.startswith('"EVALSHA')][-1]
    return {"rps": float(last.split(",")[1].strip('"')), "calls": calls,
            "server_us": (u1 - u0) / max(calls, 1), "cpu_us": 1e6 * (cpu1 - cpu0) / max(calls, 1),
            "machine_cores": (busy1 - busy0) / wall, "redis_cores": (cpu1 - cpu0) / wall}


def run_throughput(ctx: Ctx) -> list[Row]:
    rows = []
    seconds = 1.0 if ctx.quick else 2.5  # per trial: the calls are sized from a short calibration run
    scripts = sc.Scripts()
    for w in workloads():
        scripts.sha(w.script)  # a lean variant is registered when first named: loaded with the rest below
        server = RedisServer(ctx.work / f"redis-{w.script}").start()
        with services(server):
            r = redis_client(server)
            try:
                for s in scripts.scripts.values():
                    r.script_load(s.source)
                if w.setup is not None:
                    w.setup(r, scripts, KEYSPACE)
            finally:
                r.close()
            sha = scripts.sha(w.script)
            rate = benchmark(server, w, 5_000, sha)["rps"]
            requests = int(min(500_000, max(5_000, rate * seconds)))
            trials = [benchmark(server, w, requests, sha) for _ in range(ctx.trials)]
        cpu_us = median(t["cpu_us"] for t in trials)
        rows.append(Row(FIGURE, f"{w.name}: script executions/s, one redis-server (-c {CLIENTS} -P {PIPELINE})",
                        median(t["rps"] for t in trials), "calls/s",
                        extra={"script": w.script, "kind": "throughput", "cpu_us_per_call": cpu_us,
                               "server_us_per_call": median(t["server_us"] for t in trials),
                               "per_core": 1e6 / cpu_us if cpu_us else None, "trials": trials,
                               "best_cpu_us_per_call": min(t["cpu_us"] for t in trials),
                               "load_average": os.getloadavg()[0],
                               "clients": CLIENTS, "pipeline": PIPELINE, "keyspace": KEYSPACE,
                               "machine_cores": median(t["machine_cores"] for t in trials),
                               "cpus": os.cpu_count(), **w.extra}))
    return rows


# ------------------------------------------------------------------------------- memory
SLACK_MEMORY = 3_600_000  # keys outlive the measurement (the expiry is set, as always, and costs its bytes)
KEY_FORMAT = "rl:v3:{t:t%05d}:u:%016x:read"  # the agent's user key shape: tenant tag, 16-hex hash, route

#: algorithm -> (script, key suffix, ARGV): ``{i}`` in an argument is the key's number, ``{now}`` the Redis clock
MEMORY_CALLS: dict[str, tuple[str, str, list[str]]] = {
    "token_bucket": ("token_bucket", "", ["20000", "10000", "1000", "1000", str(SLACK_MEMORY)]),
    "gcra": ("gcra", "", ["20000", "10000", "1000", "1000", str(SLACK_MEMORY)]),
    "fixed_window": ("fixed_window", "", ["100", "60000", "1", str(SLACK_MEMORY)]),
    "sliding_counter": ("sliding_counter", "", ["100", "60000", "1", str(SLACK_MEMORY)]),
    "sliding_log (one entry)": ("sliding_log", "", ["100", "60000", "r{i}", "1", str(SLACK_MEMORY)]),
    "concurrency (one slot held)": ("concurrency_acquire", ":cc", ["r{i}", "10", str(SLACK_MEMORY)]),
    "pool balance (one lease)": ("pool_deposit", ":pool", ["lease-{i}", "100", "{now}", "{expires}", "16",
                                                          str(SLACK_MEMORY)]),
}
POPULATE_CHUNK = 2_000  # keys per EVAL (well under a second of Redis time each, even on a loaded machine)


def populate_script(scripts: sc.Scripts, name: str, key_expr: str) -> str:
    """A script that runs ``name``'s own code (its expanded source, as loaded) once per key number
    ``i`` in ``ARGV[1]..ARGV[2]``, its key the Lua expression ``key_expr`` of ``i`` and its ARGV
    ``ARGV[3..]`` (``{i}`` replaced by ``i``); returns the number of error replies."""
    return "\n".join([
        "local function one(KEYS, ARGV)", scripts.source(name), "end",
        "local first, last, errors = tonumber(ARGV[1]), tonumber(ARGV[2]), 0",
        "for i = first, last do",
        "  local args = {}",
        "  for j = 3, #ARGV do args[#args + 1] = string.gsub(ARGV[j], '{i}', tostring(i)) end",
        f"  local r = one({{{key_expr}}}, args)",
        "  if type(r) == 'table' and r.err then errors = errors + 1 end",
        "end",
        "return errors"])


def populate(r: redis.Redis, scripts: sc.Scripts, name: str, key_expr: str, n: int, argv: list[str]) -> None:
    """Keys ``0..n-1`` written by ``name``'s code (:func:`populate_script`), ``POPULATE_CHUNK`` per EVAL."""
    script = r.register_script(populate_script(scripts, name, key_expr))
    errors = sum(int(script(args=[i, min(i + POPULATE_CHUNK, n) - 1, *argv])) for i in range(0, n, POPULATE_CHUNK))
    if errors:
        raise RuntimeError(f"{name}: {errors} of {n} calls answered an error (bad arguments for the script?)")


def run_memory(ctx: Ctx) -> list[Row]:
    rows = []
    n = MEMORY_KEYS_QUICK if ctx.quick else MEMORY_KEYS
    scripts = sc.Scripts()
    server = RedisServer(ctx.work / "redis-memory").start()
    with services(server):
        r = redis_client(server)
        try:
            for algorithm, (name, suffix, argv) in MEMORY_CALLS.items():
                r.flushall()
                before = used_memory(r)
                now = _now_ms(r)
                args = [a.replace("{now}", str(now)).replace("{expires}", str(now + SLACK_MEMORY)) for a in argv]
                t0 = time.perf_counter()
                populate(r, scripts, name, f"string.format('{KEY_FORMAT}', i % 50000, i * 2654435761) .. '{suffix}'",
                         n, args)
                keys = r.dbsize()
                after = used_memory(r)
                if keys != n:
                    raise RuntimeError(f"{algorithm}: {keys} keys of {n}")
                sample = [r.memory_usage(k) or 0 for k in r.scan(count=1_000)[1][:200]]
                rows.append(Row(FIGURE, f"{algorithm}: bytes per key at {keys:,} keys", (after - before) / keys,
                                "bytes/key", extra={"kind": "memory", "algorithm": algorithm, "script": name,
                                                    "keys": keys, "used_memory_delta": after - before,
                                                    "memory_usage_sample_mean": sum(sample) / max(len(sample), 1),
                                                    "write_s": time.perf_counter() - t0}))
        finally:
            r.close()
    return rows


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=NORTHSTAR.parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run(ctx: Ctx) -> list[Row]:
    rows = run_throughput(ctx) + run_memory(ctx)
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10).stdout
    where = {"redis_version": version.split("v=", 1)[-1].split()[0] if "v=" in version else version.strip(),
             "commit": _commit()}
    for r in rows:
        r.extra.update(where)
    return rows
