"""Figure hotchunk: a hot tenant's flood of admitted requests on one Redis, with and without
chunks for hot key sets (``hotChunk``, region_agent.leasing.hot_chunks).

One agent process, one redis-server (one shard). One tenant's key set (tenant ``hot``, one user)
is driven as fast as the agent answers (64 connections) while 40 other tenants send a light load
(200 requests/s in all) to the same Redis. The tenant's limit is far above the flood, so every
attempt is admitted: the store calls are the admissions' own (the negative cache absorbs denied
attempts only). The bundle without ``hotChunk`` at full speed first (the flood); then without and
with ``hotChunk``, each offered :data:`PACED` of that rate, so both admit at the same rate. Per run: Redis script calls per hot attempt
(INFO commandstats, the other tenants' calls subtracted: each of theirs is one call), hot
admissions per second, and the other tenants' p99. The flood's attempts are also compared with
one Redis core's script budget for this call (CPU per call measured by figure redis).

The bound: admissions of the hot tenant stay within what its bucket allowed over the run plus the
hot-chunk term of kernel.bound (chunkMax x agent processes). Each run is measured after one
second of the same flood (the key set crosses the threshold, the agent warms up).
"""

from __future__ import annotations

import threading

import httpx

from kernel.algorithms import HotChunk
from kernel.bound import Topology, hot_chunk_term
from kernel.bundle import Bundle, encode_bundle, make_rule, seal, validate_bundle
from leasehold.commands.redis_sizing import shipped
from leasehold.local.procs import RedisServer

from .context import Ctx
from .harness import evalsha_calls, loadgen, redis_client, services, start_agent
from .stats import Goal, Row

HOT = HotChunk(threshold_per_s=200, chunk_max=200, validity_ms=250)
CAPACITY, REFILL_PER_S = 1_000_000, 100_000  # tokens: far above what one agent process can be asked
OTHER_TENANTS, OTHER_RATE = 40, 200


def bench_bundle(hot: HotChunk | None) -> Bundle:
    """The hot tenant's bucket (for tenant ``hot`` it replaces the generic one: its key set is that
    one key) and every other tenant's bucket."""
    def bucket(rule_id: str, tenant: str | None) -> object:
        return make_rule(id=rule_id, scope="tenant", tenant=tenant, algorithm="token_bucket", fail_mode="closed",
                         capacity_millis=CAPACITY * 1000, refill_millis=REFILL_PER_S * 1000, period_ms=1000,
                         cost_millis=1000, hot_chunk=hot)
    b = seal(Bundle(bundle_version=1, published_at="2026-12-01T00:00:00Z", checksum="",
                    rules=[bucket("hot-tenant", "hot"), bucket("every-tenant", None)]))
    validate_bundle(b)
    return b


def script_budget_per_s() -> float | None:
    """One Redis core's executions per second of the figure's call (a multi-rule call of one rule:
    the tenant-specific bucket replaces the generic one), from the CPU per call figure redis
    measured (the measurement shipped with ``leasehold capacity``)."""
    try:
        return 1e6 / shipped().multi_rule_cpu_us(1)
    except (OSError, KeyError, ValueError):
        return None


def _flood(ctx: Ctx, name: str, bundle: Bundle, rate: float | None) -> dict:
    work = ctx.work / f"hotchunk-{name}"
    work.mkdir(parents=True, exist_ok=True)
    policy = work / "bundle.json"
    policy.write_bytes(encode_bundle(bundle))
    duration = 2 * ctx.duration_s + 1
    flood_max = 20_000 if ctx.quick else 200_000
    redis = RedisServer(work / "redis").start()
    with services(redis):
        agent = start_agent(work / "agent", redis.url, policy=policy, extra=ctx.agent_args)
        with services(agent):
            hot = {"port": agent.port, "path": "/v1/admit", "workload": "hot_key", "count": '"allowed":true',
                   "workload_args": {"user": "hot-user", "tenant": "hot", "tag": f"h{name}"}, "conns": 64,
                   "duration_s": duration, "max_requests": flood_max}
            if rate:
                hot["rate"] = rate
            others = {"port": agent.port, "path": "/v1/admit", "workload": "tenant_admit",
                      "workload_args": {"tenants": OTHER_TENANTS, "tag": f"o{name}"}, "conns": 8,
                      "rate": OTHER_RATE, "duration_s": duration, "max_requests": int(OTHER_RATE * (duration + 2))}
            # one second of the flood first (not measured): the key set crosses the threshold and the
            # agent warms up; the figure is the steady state
            loadgen({**hot, "workload_args": {**hot["workload_args"], "tag": f"w{name}"}, "duration_s": 1.0,
                     "max_requests": flood_max})
            r = redis_client(redis)
            try:
                before = evalsha_calls(r)
                got: dict[str, dict] = {}
                side = threading.Thread(target=lambda: got.__setitem__("others", loadgen(others)))
                side.start()
                got["hot"] = loadgen(hot)
                side.join()
                calls = evalsha_calls(r) - before
                got["metrics"] = _agent_counts(agent.url)
            finally:
                r.close()
    hot_res, other_res = got["hot"], got["others"]
    for label, res in (("hot", hot_res), ("others", other_res)):
        if res["non200"] or res["errors"]:
            ctx.note(f"hotchunk {name} {label}: {res['non200']} non-200, {res['error_samples']}")
    hot_calls = max(0, calls - other_res["ok"])
    return {"attempts": hot_res["ok"], "admitted": hot_res["counted"], "elapsed_s": hot_res["elapsed_s"],
            "admitted_per_s": hot_res["counted"] / hot_res["elapsed_s"] if hot_res["elapsed_s"] else 0.0,
            "attempts_per_s": hot_res["rps"], "hot_calls": hot_calls, "redis_calls": calls,
            "calls_per_attempt": hot_calls / hot_res["ok"] if hot_res["ok"] else float("nan"),
            "others_p99_ms": other_res["p99_ms"], "others_ok": other_res["ok"], "agent": got["metrics"]}


def _agent_counts(url: str) -> dict[str, float]:
    """The agent's chunk takes by outcome, abandoned units and decisions by source (its /metrics)."""
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith(("leasehold_agent_hot_chunk", "leasehold_agent_decisions_total{")):
            name, _, value = line.rpartition(" ")
            if name.startswith("leasehold_agent_decisions_total"):
                src = name.split('source="', 1)[1].split('"', 1)[0] if 'source="' in name else "?"
                out[f"decisions source={src}"] = out.get(f"decisions source={src}", 0.0) + float(value)
            elif not name.endswith("_created"):
                out[name] = float(value)
    return out


#: Both measured runs are offered this share of what the agent answered without chunks at full
#: speed, so that both can keep up and admit at the same rate.
PACED = 0.8


def run(ctx: Ctx) -> list[Row]:
    plain_bundle = bench_bundle(None)
    flood = _flood(ctx, "max", plain_bundle, None)  # as fast as the agent answers, without chunks
    rate = PACED * flood["attempts_per_s"]
    plain = _flood(ctx, "plain", plain_bundle, rate)
    chunked_bundle = bench_bundle(HOT)
    chunked = _flood(ctx, "chunks", chunked_bundle, rate)
    term = hot_chunk_term(chunked_bundle.rules[0], Topology.uniform(1, 1)).tokens or 0
    allowed = CAPACITY + REFILL_PER_S * (chunked["elapsed_s"] + 1)  # the bucket over the run (+1 s of slack)
    bound_held = chunked["admitted"] <= allowed + term
    budget = script_budget_per_s()
    ratio = plain["calls_per_attempt"] / chunked["calls_per_attempt"] if chunked["calls_per_attempt"] else float("inf")
    extra = {"flood": flood, "offered_per_s": rate, "plain": plain, "chunks": chunked, "hot_chunk": {"thresholdPerS": HOT.threshold_per_s,
                                                             "chunkMax": HOT.chunk_max, "validityMs": HOT.validity_ms},
             "bound": {"hot_chunk_term": term, "bucket_allowed": allowed, "held": bound_held},
             "script_budget_per_s": budget,
             "flood_vs_budget": flood["attempts_per_s"] / budget if budget else None}
    if not bound_held:
        ctx.note(f"hotchunk: {chunked['admitted']} admitted beyond the bound {allowed + term}")
    rows = [
        Row("hotchunk", "hot tenant flood at full speed without chunks (x one Redis core's script budget: "
            f"{extra['flood_vs_budget'] or float('nan'):.2f})", flood["attempts_per_s"], "attempts/s"),
        Row("hotchunk", f"without chunks, offered {rate:,.0f}/s: Redis calls per attempt", plain["calls_per_attempt"],
            "calls/attempt", extra=extra),
        Row("hotchunk", f"with chunks, offered {rate:,.0f}/s: Redis calls per attempt", chunked["calls_per_attempt"],
            "calls/attempt"),
        Row("hotchunk", "calls per attempt without / with chunks (same admitted rate, bound held)", ratio
            if bound_held else 0.0, "x", goal=Goal(">=", 10)),
        Row("hotchunk", "hot admissions per second without chunks", plain["admitted_per_s"], "admits/s"),
        Row("hotchunk", "hot admissions per second with chunks", chunked["admitted_per_s"],
            "admits/s"),
        Row("hotchunk", "other tenants' p99 on the same Redis, without chunks", plain["others_p99_ms"] or float("nan"),
            "ms"),
        Row("hotchunk", "other tenants' p99 on the same Redis, with chunks", chunked["others_p99_ms"] or float("nan"),
            "ms"),
    ]
    return rows
