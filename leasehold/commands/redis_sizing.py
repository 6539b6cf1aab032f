"""Sizing the regional Redis from measured numbers: shards for a call rate, memory per copy for
an active-key count, and the hottest key's budget (docs/capacity.md, section 6).

Pure arithmetic over a :class:`Measured` record — what ``make bench``'s "redis" figure measured
(``bench/fig_redis.py``): CPU per script execution of one redis-server (so executions
per second per core), and bytes per key per algorithm. The record shipped with the package
(``redis_measured.json``) is written from a bench run by ``python -m leasehold.commands.redis_sizing
--record bench-results/results.json``, never by hand; ``leasehold capacity`` (leasehold/commands/capacity_cli.py)
and the generated tables of docs/capacity.md read it.

Units: calls per second, bytes, microseconds of one core per call.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

MEASURED_FILE = "redis_measured.json"
MAX_RULES = 8  # multi_rule.lua takes 1..8 rules
DEFAULT_UTILISATION = 0.625  # plan each primary at this share of its measured budget (the rest: hashing
#                              imbalance, a failed-over primary's load, bursts)
DEFAULT_HEADROOM = 2.0  # memory per copy = live key data x this (fragmentation, growth, a fork for a replica sync)


@dataclass(frozen=True)
class Measured:
    """One bench run's Redis measurements (see the module doc)."""

    cpu_us: dict[str, float]  # script variant -> redis-server CPU microseconds per call (median of trials)
    sustained: dict[str, float]  # script variant -> calls/s sustained in that run (on a shared machine)
    bytes_per_key: dict[str, float]  # algorithm -> bytes per key
    memory_keys: int  # keys per algorithm in the memory measurement
    meta: dict[str, Any] = field(default_factory=dict)  # when, where, redis version, machine load

    def per_core(self, variant: str) -> float:
        """Executions per second one redis-server sustains on a core of its own: ``1e6 / CPU per call``."""
        return 1e6 / self.cpu_us[variant]

    def multi_rule_cpu_us(self, rules: int) -> float:
        """CPU per multi-rule call of ``rules`` rules: measured at 1, 3 and 5; in between and up to
        8 on the least-squares line through them (one call's cost grows linearly with its rules)."""
        if not 1 <= rules <= MAX_RULES:
            raise ValueError(f"a multi-rule call takes 1..{MAX_RULES} rules")
        points = {n: self.cpu_us[multi_rule_variant(n)] for n in (1, 3, 5) if multi_rule_variant(n) in self.cpu_us}
        if rules in points:
            return points[rules]
        if len(points) < 2:
            raise ValueError("the measurement has fewer than two multi-rule sizes")
        xs, ys = list(points), list(points.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return my + slope * (rules - mx)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Measured:
        d = json.loads(text)
        return cls(cpu_us=d["cpu_us"], sustained=d["sustained"], bytes_per_key=d["bytes_per_key"],
                   memory_keys=int(d["memory_keys"]), meta=d.get("meta", {}))


def multi_rule_variant(rules: int) -> str:
    return f"multi_rule ({rules} rule{'s' if rules > 1 else ''})"


def from_results(results: dict[str, Any]) -> Measured:
    """The "redis" figure's rows of a bench ``results.json`` (already parsed)."""
    cpu: dict[str, float] = {}
    sustained: dict[str, float] = {}
    memory: dict[str, float] = {}
    keys = 0
    for row in results.get("rows", []):
        if row.get("figure") != "redis":
            continue
        extra = row.get("extra", {})
        variant = row["name"].split(":", 1)[0]
        if extra.get("kind") == "throughput" and extra.get("cpu_us_per_call"):
            cpu[variant] = round(float(extra["cpu_us_per_call"]), 2)
            sustained[variant] = round(float(row["value"]))
        elif extra.get("kind") == "memory":
            memory[variant.split(" (", 1)[0]] = round(float(row["value"]), 1)
            keys = int(extra["keys"])
    if not cpu or not memory:
        raise ValueError("the results hold no complete \"redis\" figure (run: python -m bench --only redis)")
    meta = results.get("meta", {})
    throughput = [r for r in results["rows"] if r.get("figure") == "redis" and r.get("extra", {}).get("kind") == "throughput"]
    env, first = meta.get("env", {}), throughput[0]["extra"]
    info = {"started": meta.get("started"), "quick": meta.get("quick"), "trials": meta.get("trials"),
            "commit": first.get("commit"), "redis": first.get("redis_version"), "cpus": env.get("cpus"),
            "load_average": _span(float(r["extra"].get("load_average", 0)) for r in throughput),
            "redis_cores": _span(float(t["redis_cores"]) for r in throughput for t in r["extra"]["trials"]),
            "clients": throughput[0]["extra"].get("clients"), "pipeline": throughput[0]["extra"].get("pipeline")}
    return Measured(cpu, sustained, memory, keys, {k: v for k, v in info.items() if v is not None})


def _span(values: Any) -> list[float]:
    vals = list(values)
    return [round(min(vals), 2), round(max(vals), 2)] if vals else []


def shipped() -> Measured:
    """The measurement shipped with the package (written by ``--record``)."""
    return Measured.from_json(resources.files("leasehold.commands").joinpath(MEASURED_FILE).read_text())


# ------------------------------------------------------------------------------- sizing (pure)
@dataclass(frozen=True)
class SizingPlan:
    calls_per_s: float
    rules: int
    cpu_us: float  # per multi-rule call
    per_core: float  # executions/s of one primary on a core of its own
    utilisation: float
    shards: int  # primaries
    per_shard_calls: float  # the average primary's load at that many shards
    active_keys: int
    algorithm: str
    keys_per_decision: int
    bytes_per_key: float
    live_bytes: float
    per_copy_bytes: float  # with headroom
    replicas: int
    total_bytes: float  # every copy (primaries and replicas)
    per_shard_copy_bytes: float
    hot_budget: float  # attempts/s one tenant (one slot, one primary) can send that reach Redis
    hot_room: float  # what is left of it beside the average load of the primary's other tenants


def plan(m: Measured, *, calls_per_s: float, active_keys: int, rules: int = 2, algorithm: str = "token_bucket",
         utilisation: float = DEFAULT_UTILISATION, headroom: float = DEFAULT_HEADROOM, replicas: int = 1,
         keys_per_decision: int | None = None) -> SizingPlan:
    """The sizing of docs/capacity.md section 6 for ``calls_per_s`` admission calls (one multi-rule
    script each, ``rules`` rules) and ``active_keys`` keys of ``algorithm``."""
    if calls_per_s <= 0 or active_keys < 0:
        raise ValueError("calls per second must be positive and active keys not negative")
    if not 0 < utilisation <= 1:
        raise ValueError("utilisation is a share of a primary's budget, in (0, 1]")
    if headroom < 1 or replicas < 0:
        raise ValueError("headroom must be >= 1 and replicas >= 0")
    if algorithm not in m.bytes_per_key:
        raise ValueError(f"no measured bytes per key for {algorithm!r} (measured: {', '.join(sorted(m.bytes_per_key))})")
    cpu = m.multi_rule_cpu_us(rules)
    per_core = 1e6 / cpu
    shards = max(1, math.ceil(calls_per_s / (per_core * utilisation)))
    live = active_keys * m.bytes_per_key[algorithm]
    per_copy = live * headroom
    return SizingPlan(calls_per_s, rules, cpu, per_core, utilisation, shards, calls_per_s / shards, active_keys, algorithm,
                keys_per_decision or rules, m.bytes_per_key[algorithm], live, per_copy, replicas,
                per_copy * (1 + replicas), per_copy / shards, per_core, per_core - calls_per_s / shards)


def _mb(b: float) -> str:
    return f"{b / 1e6:,.0f} MB" if b < 1e9 else f"{b / 1e9:,.2f} GB"


def describe(p: SizingPlan, m: Measured) -> list[str]:
    """The plan in sentences (the CLI's output; the docs' worked example)."""
    where = m.meta
    return [
        f"measured: one redis-server spends {p.cpu_us:.1f} us of CPU per multi-rule call of {p.rules} rule(s) "
        f"({p.per_core:,.0f} executions/s on a core of its own; pipelines of {where.get('pipeline', 32)}); "
        f"{p.bytes_per_key:.0f} bytes per {p.algorithm} key at {m.memory_keys:,} keys",
        f"shards: {p.calls_per_s:,.0f} calls/s / ({p.per_core:,.0f} x {p.utilisation:.3g}) -> {p.shards} primaries "
        f"({p.per_shard_calls:,.0f} calls/s each on average, {p.per_shard_calls / p.per_core:.0%} of a primary's budget)",
        f"memory: {p.active_keys:,} keys x {p.bytes_per_key:.0f} B = {_mb(p.live_bytes)} live; x {DEFAULT_HEADROOM:g} "
        f"headroom = {_mb(p.per_copy_bytes)} per copy ({_mb(p.per_shard_copy_bytes)} per primary); with "
        f"{p.replicas} replica(s) per primary {_mb(p.total_bytes)} in all",
        f"hottest key: one tenant's keys share one slot, so one primary: at most {p.hot_budget:,.0f} attempts/s "
        f"reaching Redis ({p.hot_budget / p.calls_per_s:.1%} of the total); beside the average load of its "
        f"primary's other tenants {max(0.0, p.hot_room):,.0f}/s are left; adding shards does not raise it "
        "(the negative cache and chunks keep attempts from reaching Redis)",
    ]


# ------------------------------------------------------------------------------- docs/capacity.md tables
WORKED = (500_000, 2_000_000)  # the reference sizing: 500,000 calls/s at the peak, 2 million active keys
HOT_FLOOD = 75_000  # ... and one tenant flooding at 15 % of that peak


def _when(m: Measured) -> str:
    import time

    started = m.meta.get("started")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(started))) if started else "?"
    load, cores = m.meta.get("load_average") or ["?", "?"], m.meta.get("redis_cores") or ["?", "?"]
    return (f"Measured {when}, commit {m.meta.get('commit', '?')}, redis {m.meta.get('redis', '?')}, "
            f"{'quick' if m.meta.get('quick') else 'full'} run ({m.meta.get('trials', '?')} trial(s), median), "
            f"on a shared {m.meta.get('cpus', '?')}-core machine: load average {load[0]}-{load[-1]}, redis-server "
            f"given {cores[0]}-{cores[-1]} of a core.")


def markdown_measured(m: Measured | None = None) -> str:
    """The measurement as docs/capacity.md shows it (generated: ``make doc-tables``)."""
    m = m or shipped()
    lines = [_when(m), "",
             f"| script (pipelines of {m.meta.get('pipeline', 32)}, {m.meta.get('clients', 16)} connections) | "
             "CPU per call | executions/s on one core (`1e6 / CPU`) | sustained here |",
             "|---|---|---|---|"]
    for name in sorted(m.cpu_us, key=lambda n: (not n.startswith("multi_rule"), n)):
        lines.append(f"| `{name}` | {m.cpu_us[name]:.1f} us | {m.per_core(name):,.0f} | {m.sustained[name]:,.0f} |")
    lines += ["", f"| algorithm | bytes per key at {m.memory_keys:,} keys |", "|---|---|"]
    for name, b in sorted(m.bytes_per_key.items()):
        lines.append(f"| {name} | {b:.0f} |")
    return "\n".join(lines) + "\n"


def markdown_worked(m: Measured | None = None) -> str:
    """The reference sizing worked through with the measured numbers (generated)."""
    m = m or shipped()
    calls, keys = WORKED
    lines = ["| rules per call | CPU per call | one primary (one core) | primaries at 62.5 % | average per primary |",
             "|---|---|---|---|---|"]
    plans = {n: plan(m, calls_per_s=calls, active_keys=keys, rules=n) for n in (1, 2, 3, 5)}
    for n, p in plans.items():
        lines.append(f"| {n}{' (Northstar read)' if n == 2 else ''} | {p.cpu_us:.1f} us | {p.per_core:,.0f}/s | "
                     f"**{p.shards}** | {p.per_shard_calls:,.0f}/s |")
    p = plans[2]
    lines += ["", "| memory (token buckets) | |", "|---|---|",
              f"| live key data: {keys:,} keys x {p.bytes_per_key:.0f} B | {_mb(p.live_bytes)} |",
              f"| per copy, x {DEFAULT_HEADROOM:g} headroom | {_mb(p.per_copy_bytes)} |",
              f"| a primary and one replica | {_mb(p.total_bytes)} |",
              f"| per primary at {p.shards} primaries | {_mb(p.per_shard_copy_bytes)} |",
              "", "| the hottest key (one tenant = one slot = one primary) | |", "|---|---|",
              f"| attempts/s one primary runs (2-rule calls) | {p.hot_budget:,.0f} |",
              f"| left beside the average load of its other tenants | {max(0.0, p.hot_room):,.0f} |",
              f"| a flood at 15 % of the peak | {HOT_FLOOD:,}/s = {HOT_FLOOD / p.hot_budget:.1f} x one primary |",
              f"| share of that flood the negative cache and chunks must keep from Redis | "
              f"{max(0.0, 1 - max(0.0, p.hot_room) / HOT_FLOOD):.0%} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leasehold.commands.redis_sizing",
                                 description="Write the shipped Redis measurement from a bench run's results.json.")
    ap.add_argument("--record", required=True, metavar="RESULTS", type=Path, help="bench-results/results.json")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / MEASURED_FILE)
    a = ap.parse_args(argv)
    try:
        measured = from_results(json.loads(a.record.read_text()))
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot record {a.record}: {e}", file=sys.stderr)
        return 2
    a.out.write_text(measured.to_json())
    print(f"wrote {a.out} ({len(measured.cpu_us)} scripts, {len(measured.bytes_per_key)} algorithms); "
          "then: make doc-tables (docs/capacity.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
