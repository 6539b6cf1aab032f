"""Run a chaos scenario end to end: start the topology (3-member etcd, allocators, regions
with Redis and agents, every link through a fault proxy), drive bounded load, run the
scenario's nemesis schedule, record the history, read etcd back, run the checker, check the
scenario's expectations (the fault really happened), write the report directory.

    python -m chaos run --scenario kill-leader --seed 3 --duration 30
    python -m chaos run --profile short        # the short profile (also a pytest test)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from chaos.invariants import DEFAULT_TOLERANCE_MS, PoolPolicy
from kernel.bundle import Bundle, encode_bundle
from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore

from . import bundles
from .checker import Report, check
from .etcd_records import RecordKeeper, read_back
from .history import Counters, Fault, HistoryWriter, Meta, Policy, TopologyRec, now_ms, read_history
from .lease_driver import DriverStats, LeaseDriver
from .load import CounterSampler, LeasePoller, LoadGen
from .nemesis import Nemesis, Schedule, Step
from .rlqs import EnvoyLoad, record_decisions, rlqs_record
from .scenarios import REDIS_GRACE_MS, Scenario, resolve
from .topo import PREFIX, ChaosSpec, ChaosTopology

MAX_DURATION_S = 1800.0


@dataclass
class RunContext:
    topo: ChaosTopology
    history: HistoryWriter
    bundle: Bundle
    duration_s: float
    seed: int
    load: LoadGen | None = None  # set before the schedule starts
    leaders: list[tuple[int, str | None]] = field(default_factory=list)
    redis_faults: list[tuple[str, Nemesis]] = field(default_factory=list)
    driver_stats: DriverStats | None = None
    driver: LeaseDriver | None = None
    final_bundle_versions: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], int] = now_ms
    envoy_load: EnvoyLoad | None = None  # clients through the RLQS Envoys (spec.envoys)
    envoy_logged: dict[str, dict[str, int]] = field(default_factory=dict)  # per Envoy, from its access log

    async def publish(self, b: Bundle) -> None:
        assert self.topo.etcd is not None
        store = EtcdStore(self.topo.etcd.endpoints, timeout_s=3.0)
        try:
            await PolicyStore(store, PREFIX).publish(encode_bundle(b))
        finally:
            await store.close()

    def faults_recorded(self) -> int:
        return sum(1 for r in read_history(self.history.path) if isinstance(r, Fault))

    def is_local(self, region: str, at_ms: int) -> bool:
        for r, n in self.redis_faults:
            if r == region and n.started_ms is not None and n.started_ms <= at_ms:
                stop = n.stopped_ms if n.stopped_ms is not None else at_ms
                if at_ms <= stop + REDIS_GRACE_MS:
                    return True
        return False


@dataclass
class RunResult:
    name: str
    seed: int
    duration_s: float
    report: Report
    unmet: list[str]
    out_dir: Path
    stats: dict

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.unmet


def _line(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


async def _watch_leaders(ctx: RunContext, stop: asyncio.Event) -> None:
    """Record every leader term (of every shard when the allocator is sharded; ``ctx.leaders``
    follows the leader of shard 0, the only one when unsharded), and every change of shard 0's
    leader key state (present with an epoch, absent, or unreadable: no etcd quorum; sharded, also
    how many shards have a leader) as a ``counters`` sample of ``leader-key``, so a run shows when
    the allocators had no leader."""
    seen: set[tuple[int, int]] = set()
    last: dict[str, float] | None = None
    assert ctx.topo.etcd is not None
    store = EtcdStore(ctx.topo.etcd.endpoints, timeout_s=2.0)  # one client for the run, not one per poll
    try:
        while not stop.is_set():
            leaders = await ctx.topo.leader_state(store)
            for rec in leaders or ():
                if (rec.shard, rec.epoch) in seen:
                    continue
                seen.add((rec.shard, rec.epoch))
                ctx.history.write(rec)
                if rec.shard == 0 and (not ctx.leaders or ctx.leaders[-1][0] != rec.epoch):
                    ctx.leaders.append((rec.epoch, rec.node))
            # present: 1 with the epoch, 0 absent, -1 unknown (etcd had no quorum for the read)
            first = next((r for r in leaders or () if r.shard == 0), None)
            state = ({"epoch": float(first.epoch), "present": 1.0} if first is not None
                     else {"present": 0.0 if leaders is not None else -1.0})
            if leaders is not None and ctx.topo.spec.shards > 1:
                state["shardsLed"] = float(len({r.shard for r in leaders}))
            if state != last:
                last = state
                ctx.history.write(Counters(service="leader-key", at_ms=now_ms(), values=state))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5 if ctx.topo.spec.shards == 1 else 0.25)
    finally:
        await store.close()


async def _live(ctx: RunContext, out: TextIO, stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 3.0)
        assert ctx.load is not None
        parts = [f"{r}: {s.sent} sent {s.allowed} ok {s.denied} denied {s.fallback} fb {s.errors} err"
                 for r, s in ctx.load.stats.items()]
        if ctx.envoy_load is not None:
            e = ctx.envoy_load.stats
            parts.append(f"envoys: {e.sent} sent {e.allowed} ok {e.denied} denied {e.other + e.errors} err")
        active = [f"{n.name}@{n.target}" for _r, n in ctx.redis_faults if n.active]
        epoch = ctx.leaders[-1] if ctx.leaders else None
        _line(out, f"  [{time.monotonic() - t0:5.1f}s] " + " | ".join(parts)
              + f" | leader {epoch[1] if epoch else '?'}#{epoch[0] if epoch else '?'}"
              + (f" | redis faults {active}" if active else ""))


def _jitter(steps: list[Step], seed: int, duration_s: float) -> list[Step]:
    """Move each fault by up to ±5% of the run (seeded), so seeds also vary the schedule. The steps
    of one ``group`` move by the same amount (the first one's): faults placed relative to each other
    (one must have shown its effect before the next begins) keep their spacing."""
    rng = random.Random(f"schedule-{seed}")
    shifts: dict[str, float] = {}
    out = []
    for st in steps:
        shift = rng.uniform(-0.05, 0.05) * duration_s
        if st.group is not None:
            shift = shifts.setdefault(st.group, shift)
        at = min(duration_s, max(0.0, st.at_s + shift))
        out.append(Step(at, st.nemesis, st.duration_s, st.group))
    return out


async def _save_metrics(ctx: RunContext, out_dir: Path) -> None:
    """Every service's own counters at the end of the run (degradations by reason, lease outcomes,
    pool admissions by source): ``metrics/<service>.txt`` in the report, to explain a verdict."""
    (out_dir / "metrics").mkdir(parents=True, exist_ok=True)
    services = [(g.name, g.url) for g in ctx.topo.agents] + [(a.name, a.url) for a in ctx.topo.allocators]
    async with httpx.AsyncClient(timeout=2.0) as c:
        for name, url in services:
            with contextlib.suppress(httpx.HTTPError):
                r = await c.get(url + "/metrics")
                lines = [ln for ln in r.text.splitlines() if ln.startswith("leasehold_") and not ln.endswith(" 0.0")]
                (out_dir / "metrics" / f"{name}.txt").write_text("\n".join(lines) + "\n")


def _save_envoy_stats(fleet, out_dir: Path) -> None:
    """Every Envoy's quota filter and RLS counters at the end of the run (``metrics/<envoy>.txt``)."""
    (out_dir / "metrics").mkdir(parents=True, exist_ok=True)
    for e in fleet.envoys:
        with contextlib.suppress(httpx.HTTPError, OSError):
            counters = e.envoy.stats()
            lines = [f"{k} {v}" for k, v in sorted(counters.items())
                     if v and ("quota" in k or "ratelimit" in k or k.startswith("http.api.downstream_rq_"))]
            (out_dir / "metrics" / f"{e.name}.txt").write_text("\n".join(lines) + "\n")


async def _final_policy(ctx: RunContext) -> None:
    async with httpx.AsyncClient(timeout=2.0) as c:
        for g in ctx.topo.agents:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = await c.get(g.url + "/v1/policy")
                if r.status_code == 200:
                    body = r.json()
                    ctx.final_bundle_versions[g.name] = int(body.get("bundleVersion") or body.get("version"))


async def run_scenario(name: str, seed: int, duration_s: float, out_root: Path, *, out: TextIO = sys.stdout,
                       tolerance_ms: int = DEFAULT_TOLERANCE_MS, keep_passing: bool = False) -> RunResult:
    if not (5.0 <= duration_s <= MAX_DURATION_S):
        raise ValueError(f"duration must be in [5, {MAX_DURATION_S}] s")
    scenarios: list[Scenario] = resolve(name)
    out_dir = out_root / f"{name}-seed{seed}-{time.strftime('%Y%m%dT%H%M%S')}"  # out_root is absolute
    run_dir = out_dir / "run"
    bundle = bundles.chaos_bundle()
    policy = bundles.write(run_dir / "policy.json", bundle)
    spec = ChaosSpec(run_dir=run_dir, policy=policy, seed=seed)
    for s in scenarios:
        s.configure(spec)
    history = HistoryWriter(out_dir / "history.jsonl")
    initial = PoolPolicy.from_bundle(bundle)
    history.write(Meta(scenario=name, seed=seed, started_at_ms=now_ms(), duration_s=duration_s,
                       note=" / ".join(s.doc for s in scenarios), shards=spec.shards))
    history.write(Policy(version=bundle.bundle_version, applied_at_ms=None, pools=initial))
    _line(out, f"== {name} seed={seed} duration={duration_s:.0f}s -> {out_dir}")
    topo = ChaosTopology(spec)
    stats: dict = {}
    unmet: list[str] = []
    try:
        await asyncio.to_thread(topo.start)
        history.write(TopologyRec(agents={r: [g.name for g in topo.agents_in(r)] for r in spec.regions},
                                  allocator_offsets_ms={a.name: spec.clock_offsets_ms.get(a.name, 0)
                                                        for a in topo.allocators},
                                  redis_offsets_ms={r: spec.clock_offsets_ms.get(f"redis-{r}", 0)
                                                    for r in spec.regions}))
        ctx = RunContext(topo, history, bundle, duration_s, seed)
        if topo.envoys is not None:
            history.write(rlqs_record(topo.envoys, bundle))
            ctx.envoy_load = EnvoyLoad(topo.envoys, seed=seed)
        first = await topo.wait_leader(20.0)
        if first is None:
            raise RuntimeError("no allocator leader elected")
        regions = list(spec.regions)
        ctx.load = LoadGen(bundle, lambda r: [(g.name, g.url) for g in topo.agents_in(r)], regions, history,
                           is_local=ctx.is_local, seed=seed)
        poller = LeasePoller(history, lambda: [(g.name, g.region, g.url) for g in topo.agents])
        # a third "region" that knows its leases: its spends carry lease ids, so the per-lease checks
        # (spend within grant, no spend after expiry) are judged in every run; the lease-replay
        # scenario makes it replay often and late
        replaying = any(s.lease_driver for s in scenarios)
        driver = LeaseDriver(region="drv", pool="atlas-w", urls=[a.url for a in topo.allocators], history=history,
                             want=4, interval_s=0.25, replay_probability=0.6 if replaying else 0.1,
                             replay_delay_ms=(200, 4000) if replaying else (0, 500), timeout_s=1.0, seed=seed,
                             run_id=f"chaos{seed}")
        ctx.driver = driver
        steps = _jitter([st for s in scenarios for st in s.steps(ctx)], seed, duration_s)
        schedule = Schedule(duration_s, steps)
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = CounterSampler(history, lambda: [(g.name, g.url) for g in topo.agents])
        assert topo.etcd is not None
        keeper = RecordKeeper(topo.etcd.endpoints, PREFIX)  # records that expire before the final read
        bg = [asyncio.create_task(_watch_leaders(ctx, stop)), asyncio.create_task(_live(ctx, out, stop, t0)),
              asyncio.create_task(poller.run(duration_s + 5.0, stop=stop)),
              asyncio.create_task(sampler.run(duration_s + 5.0, stop=stop)), asyncio.create_task(keeper.run(stop))]
        bg.append(asyncio.create_task(driver.run(duration_s)))
        try:
            await asyncio.gather(ctx.load.run(duration_s, max_requests=int(duration_s * 400)), schedule.run(),
                                 *([ctx.envoy_load.run(duration_s)] if ctx.envoy_load is not None else []))
            ctx.driver_stats = await bg[-1]
        finally:
            stop.set()
            ctx.load.stop()
            for t in bg:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*bg, return_exceptions=True)
        async with httpx.AsyncClient(timeout=1.0) as client:
            await poller.poll_once(client)
        await _final_policy(ctx)
        await _save_metrics(ctx, out_dir)
        if topo.envoys is not None:  # stopped first: Envoy writes out its access log as it exits
            await asyncio.to_thread(_save_envoy_stats, topo.envoys, out_dir)
            await asyncio.to_thread(topo.envoys.stop)
            ctx.envoy_logged = record_decisions(topo.envoys, bundle, history)
        cur = await topo.wait_leader(10.0)
        if cur is not None and (not ctx.leaders or ctx.leaders[-1][0] != cur[0]):
            ctx.leaders.append(cur)
        history.write_all(await read_back(topo.etcd.endpoints, PREFIX, kept=keeper))
        for s in scenarios:
            for e in s.expect:
                unmet += e(ctx)
        stats = {"load": {r: {k: v for k, v in vars(s).items() if k != "per_agent"} | {"perAgent": dict(s.per_agent)}
                          for r, s in ctx.load.stats.items()},
                 "leaders": [{"epoch": e, "node": n} for e, n in ctx.leaders],
                 "leasePolls": poller.polls, "policyVersions": ctx.final_bundle_versions,
                 "driver": vars(ctx.driver_stats) if ctx.driver_stats else None}
        if ctx.envoy_load is not None:
            e = ctx.envoy_load.stats
            stats["envoys"] = {k: v for k, v in vars(e).items() if k not in ("per_envoy", "error_kinds")} | {
                "perEnvoy": dict(e.per_envoy), "errorKinds": dict(e.error_kinds), "accessLog": ctx.envoy_logged}
    finally:
        await asyncio.to_thread(topo.stop)
        history.close()
    report = check(history.path, bundle, tolerance_ms)
    result = RunResult(name, seed, duration_s, report, unmet, out_dir, stats)
    from .report import write_report

    write_report(result)
    _line(out, report.render())
    for u in unmet:
        _line(out, f"  [FAIL] expectation: {u}")
    _line(out, f"== {name} seed={seed}: {'PASS' if result.ok else 'FAIL'} (report {out_dir})")
    if result.ok and not keep_passing:
        shutil.rmtree(run_dir, ignore_errors=True)  # logs and data dirs; the history stays in the report
    return result
