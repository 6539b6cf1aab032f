"""Named chaos scenarios: each configures the topology, builds a nemesis schedule over the
run's duration and states what must be observed for the fault to count as injected (e.g.
fallback decisions during an allocator partition, a leader change after a kill).

Scenarios combine: ``--scenario a+b`` runs both schedules together (see :func:`resolve`).
Offsets are fractions of the run's duration, so the same scenario works at 20 s or 5 min.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chaos.invariants import PoolPolicy
from kernel.errors import BadRequest

from . import bundles
from .history import Policy
from .nemesis import (
    Custom,
    Effects,
    EtcdMemberIsolate,
    Kill,
    Latency,
    Nemesis,
    Partition,
    Pause,
    RedisRestart,
    Step,
    faketime_env,
)

if TYPE_CHECKING:
    from .run import RunContext
    from .topo import ChaosSpec


Expect = Callable[["RunContext"], list[str]]  # -> unmet expectations (empty = the fault showed)

#: How long after a fault stops its effect may last: an agent notices a healed allocator link on its
#: next lease request (tick 50 ms, deadline 900 ms, a new leader's first grant) and a healed Redis
#: when its breaker half-opens (500 ms) and the connection pool reconnects.
ALLOCATOR_GRACE_MS = 3_000
REDIS_GRACE_MS = 3_000

#: How long a region must be cut off from the allocators *with its Redis reachable* before a correct
#: agent has answered from the regional fallback (``fallback_in``): an agent spends its leases and
#: denies while the allocator says a window is spent, so a balance is empty and not exhausted at the
#: latest when the longest pool window of the chaos bundle that was running at the cut has ended (a
#: lease lives no longer than its window), and the region knows the allocator unreachable once a lease
#: request failed (the agents' allocator deadline, chaos/topo.py), plus a margin for the next request.
FALLBACK_SHOWS_MS = max(bundles.WINDOW_MS, bundles.GLOBAL_WINDOW_MS) + 1_500 + 500


@dataclass
class Scenario:
    name: str
    doc: str
    steps: Callable[[RunContext], list[Step]]
    configure: Callable[[ChaosSpec], None] = lambda spec: None
    expect: list[Expect] = field(default_factory=list)
    lease_driver: bool = False  # run a LeaseDriver with duplicated/delayed lease-id replays
    profiled: bool = True  # in the full profile (make chaos); False: run by name only (a measurement)


# ----------------------------------------------------------------------------- nemeses on the leader
def _all_regions(ctx: RunContext) -> Effects:
    """No region can get a grant while the allocator has no working leader."""
    return Effects(allocator_regions=tuple(ctx.topo.spec.regions), grace_ms=ALLOCATOR_GRACE_MS)


class _OnLeader(Nemesis):
    """Resolve the allocator leader when the fault starts (not when the schedule is built).
    Every region may lose its grants until a new leader serves them."""

    def __init__(self, ctx: RunContext, **kw):
        kw.setdefault("effects", _all_regions(ctx))
        super().__init__("allocator-leader", recorder=ctx.history, **kw)
        self.ctx = ctx
        self.inner: Nemesis | None = None

    def make(self, alloc) -> Nemesis:
        raise NotImplementedError

    async def _start(self) -> None:
        cur = await self.ctx.topo.wait_leader(10.0)
        alloc = self.ctx.topo.allocator_by_node(cur[1] if cur else None) or self.ctx.topo.allocators[0]
        self.target = alloc.name
        self.inner = self.make(alloc)
        await self.inner.start()

    async def _stop(self) -> None:
        if self.inner is not None:
            await self.inner.stop()


class LeaderKill(_OnLeader):
    name = "kill-leader"

    def make(self, alloc) -> Nemesis:
        return Kill(alloc.proc, ready=self.ctx.topo.ready_callback(alloc.url))


class LeaderPause(_OnLeader):
    name = "pause-leader"

    def make(self, alloc) -> Nemesis:
        return Pause(alloc.proc)


class LeaderEtcdPartition(_OnLeader):
    name = "partition-leader-etcd"

    def make(self, alloc) -> Nemesis:
        from .nemesis import Combined

        return Combined(*[Partition(p, target=p.name) for p in alloc.etcd_proxies])


class ReplicaJoin(Nemesis):
    """A standby allocator replica starts (a join: the shards that now hash to it are handed off
    to it); at stop it is SIGTERMed (a graceful leave: it stops accepting, drains, revokes its
    lease, and the others take its shards at their next poll). A handed-off shard answers
    not-leader for a moment, so every region may briefly lose grants of the moving pools."""

    name = "allocator-join"

    def __init__(self, ctx: RunContext, alloc):
        super().__init__(alloc.name, recorder=ctx.history, effects=_all_regions(ctx))
        self.ctx, self.alloc = ctx, alloc

    async def _start(self) -> None:
        self.alloc.proc.start()
        await asyncio.to_thread(self.ctx.topo.wait_ready, 60.0, [(self.alloc.url, self.alloc.proc)])

    async def _stop(self) -> None:
        await asyncio.to_thread(self.alloc.proc.stop)


class ReplicaLeave(ReplicaJoin):
    """A running replica is SIGTERMed (a graceful leave), and started again at stop (a join)."""

    name = "allocator-leave"

    async def _start(self) -> None:
        await ReplicaJoin._stop(self)

    async def _stop(self) -> None:
        await ReplicaJoin._start(self)


def _rebalance(ctx: RunContext) -> list[Step]:
    """With three replicas leading 64 shards and one standby: the standby joins and later leaves;
    then one of the three (seeded) leaves and joins again."""
    standby = ctx.topo.allocators[-1]
    leaver = ctx.topo.allocators[ctx.seed % (len(ctx.topo.allocators) - 1)]
    return [Step(_at(ctx, 0.15), ReplicaJoin(ctx, standby), _at(ctx, 0.35)),
            Step(_at(ctx, 0.6), ReplicaLeave(ctx, leaver), _at(ctx, 0.2))]


def _sharded(spec: ChaosSpec) -> None:
    spec.allocators, spec.standby_allocators, spec.shards = 3, 1, 64


def shards_rebalanced(ctx: RunContext) -> list[str]:
    """Shards moved with the joins and leaves: all four replicas led shards at some point, and
    many shards had more than one leader term."""
    from .history import Leader, read_history

    terms = {(r.shard, r.epoch): r.node for r in read_history(ctx.history.path) if isinstance(r, Leader)}
    nodes = set(terms.values())
    shards = ctx.topo.spec.shards
    moved = len(terms) - len({s for s, _e in terms})
    out = []
    if len(nodes) < len(ctx.topo.allocators):
        out.append(f"only {sorted(n or '?' for n in nodes)} led shards; every replica should have")
    if moved < shards // 4:
        out.append(f"only {moved} leadership changes over {shards} shards")
    if len({s for s, _e in terms}) < shards:
        out.append(f"only {len({s for s, _e in terms})} of {shards} shards ever had a leader")
    return out


def _region_partition(ctx: RunContext, region: str, direction: str = "both") -> Nemesis:
    from .nemesis import Combined

    parts = [Partition(p, direction, target=p.name) for p in ctx.topo.region_links[region]]
    return Combined(*parts, recorder=ctx.history,
                    effects=Effects(allocator_regions=(region,), grace_ms=ALLOCATOR_GRACE_MS))


def _rec(n: Nemesis, ctx: RunContext) -> Nemesis:
    n.recorder = ctx.history
    return n


def _redis_effects(ctx: RunContext, region: str) -> Effects:
    return Effects(redis_agents=tuple(g.name for g in ctx.topo.agents_in(region)), grace_ms=REDIS_GRACE_MS)


def _redis_partition(ctx: RunContext, region: str) -> Nemesis:
    from .nemesis import Combined

    n = Combined(*[Partition(g.redis_proxy, target=g.redis_proxy.name) for g in ctx.topo.agents_in(region)],
                 recorder=ctx.history, effects=_redis_effects(ctx, region))
    ctx.redis_faults.append((region, n))
    return n


def _redis_restart(ctx: RunContext, region: str) -> Nemesis:
    n = _rec(RedisRestart(ctx.topo.redis[region], effects=_redis_effects(ctx, region)), ctx)
    ctx.redis_faults.append((region, n))
    return n


class RedisPause(Nemesis):
    """SIGSTOP the region's redis-server (resolved when the fault starts: a restart replaces the
    process), SIGCONT at stop: connections stay open, every call hangs until its timeout."""

    name = "redis-pause"

    def __init__(self, ctx: RunContext, region: str):
        super().__init__(f"redis-{region}", recorder=ctx.history, effects=_redis_effects(ctx, region))
        self.server = ctx.topo.redis[region]
        self._proc = None

    async def _start(self) -> None:
        self._proc = self.server.proc
        assert self._proc is not None, "redis server not started"
        self._proc.signal(signal.SIGSTOP)

    async def _stop(self) -> None:
        if self._proc is not None:
            self._proc.signal(signal.SIGCONT)


def _redis_pause(ctx: RunContext, region: str) -> Nemesis:
    n = RedisPause(ctx, region)
    ctx.redis_faults.append((region, n))
    return n


# ----------------------------------------------------------------------------- a Redis Cluster primary
#: the tenant whose Redis Cluster primary the cluster scenarios stop or kill, and the tenants of the
#: load (chaos/load.py) whose slots live on the other primaries (``redis-cli --cluster create``'s even
#: split: atlas's slot 4037 on the first primary, birch and cedar on the second, dune on the third)
CLUSTER_REGION, CLUSTER_TENANT, OTHER_SHARD_TENANTS = "eu", "atlas", ("birch", "cedar", "dune")


def _on_cluster(spec: ChaosSpec) -> None:
    spec.redis_cluster = (CLUSTER_REGION,)


def _on_cluster_with_replica(spec: ChaosSpec) -> None:
    spec.redis_cluster, spec.redis_cluster_replicas = (CLUSTER_REGION,), (0,)


class ClusterPrimaryFault(Nemesis):
    """SIGSTOP (or, with ``kill``, SIGKILL) the Redis Cluster primary owning ``tenant``'s slot,
    resolved when the fault starts; at stop SIGCONT (or start the killed node again: when its
    replica was promoted meanwhile it rejoins as that one's replica). Only that primary's tenants
    lose their store; for the bound, every agent of the region counts as cut off from Redis
    (the fault terms are per agent, not per shard: conservative)."""

    name = "redis-cluster-primary"

    def __init__(self, ctx: RunContext, region: str, tenant: str, *, kill: bool = False):
        super().__init__(f"redis-{region}:{{t:{tenant}}}", recorder=ctx.history, effects=_redis_effects(ctx, region),
                         detail="SIGKILL, restarted at stop" if kill else "SIGSTOP, SIGCONT at stop")
        self.ctx, self.region, self.tenant, self.kill = ctx, region, tenant, kill
        self.node = None
        ctx.redis_faults.append((region, self))

    async def _start(self) -> None:
        from region_agent.store.slots import slot_of

        cluster = self.ctx.topo.clusters[self.region]
        node = self.node = await asyncio.to_thread(cluster.owner, slot_of(f"{{t:{self.tenant}}}"))
        self.detail += f" (primary {node.port})"
        assert node.proc is not None
        if self.kill:
            await asyncio.to_thread(node.proc.kill)
        else:
            node.proc.signal(signal.SIGSTOP)

    async def _stop(self) -> None:
        node = self.node
        if node is None:
            return
        if self.kill:
            await asyncio.to_thread(node.start)
        elif node.proc is not None:
            node.proc.signal(signal.SIGCONT)


def shard_isolated(region: str, stopped: str, others: tuple[str, ...], *, served_again: bool = False) -> Expect:
    """The other primaries' tenants saw no fallback, no local allowance, no 503 and no failed
    request in ``region`` during the whole run; the stopped primary's tenant got local-allowance
    decisions (its fail modes); with ``served_again``, it was served by the store again before
    the fault stopped (a replica promoted by the cluster's failover)."""
    def check(ctx: RunContext) -> list[str]:
        from .history import DecisionRec, read_history

        recs = [r for r in read_history(ctx.history.path) if isinstance(r, DecisionRec) and r.region == region]
        out = []
        bad = [r for r in recs if r.tenant in others
               and (r.fallback or r.local or r.reason in ("OVERLOADED", "LIMITER_UNAVAILABLE"))]
        if bad:
            out.append(f"{len(bad)} decision(s) of {others} degraded in {region} (first: {bad[0].tenant} "
                       f"{bad[0].route_group} {bad[0].reason} fallback={bad[0].fallback} local={bad[0].local})")
        errors = {t: ctx.load.stats[region].errors_by_tenant[t] for t in others if ctx.load.stats[region].errors_by_tenant[t]}
        if errors:
            out.append(f"requests of {others} without a decision in {region}: {errors}")
        if not any(r.tenant == stopped and r.local for r in recs):
            out.append(f"no local-allowance decision for {stopped} in {region}")
        if served_again:
            fault = next(n for rg, n in ctx.redis_faults if rg == region and isinstance(n, ClusterPrimaryFault))
            start, stop = fault.started_ms or 0, fault.stopped_ms or 0
            again = [r for r in recs if r.tenant == stopped and start < (r.sent_at_ms or 0) and r.recorded_at_ms < stop
                     and not r.fallback and not r.local and r.reason != "LIMITER_UNAVAILABLE"]
            if not again:
                out.append(f"{stopped} was never served by a promoted replica while its primary was down")
        return out
    return check


def _both(ctx: RunContext, make: Callable[[RunContext, str], Nemesis]) -> Nemesis:
    parts = [make(ctx, r) for r in ctx.topo.spec.regions]
    return Combined2(ctx, *parts)


def _policy_rollback(ctx: RunContext) -> list[Step]:
    """Publish a tightened bundle (v8: G halved), then the original content as v9 (a rollback
    published as a higher version)."""
    base = ctx.bundle
    tight = bundles.chaos_bundle(version=base.bundle_version + 1, scale=0.5)
    rollback = bundles.with_version(base, base.bundle_version + 2)

    def publisher(b):
        async def go() -> None:
            await ctx.publish(b)
            ctx.history.write(Policy(version=b.bundle_version, applied_at_ms=ctx.clock(),
                                     pools=PoolPolicy.from_bundle(b)))
        return go

    d = ctx.duration_s
    return [Step(0.3 * d, Custom("publish-policy", f"v{tight.bundle_version} (G x0.5)", publisher(tight),
                                 recorder=ctx.history), 0),
            Step(0.6 * d, Custom("publish-policy", f"v{rollback.bundle_version} (rollback to v{base.bundle_version})",
                                 publisher(rollback), recorder=ctx.history), 0)]


def _replay_stale(ctx: RunContext) -> Nemesis:
    """Replay requests whose grants came from a deposed epoch (after the failover)."""
    async def go() -> None:
        assert ctx.driver is not None, "the lease-replay scenario runs a lease driver"
        await ctx.driver.replay_stale(5)

    return Custom("replay-stale-epoch-grant", "allocator", go, recorder=ctx.history)


# ----------------------------------------------------------------------------- Envoys holding RLQS assignments
#: the RLQS scenario's Envoys (chaos/rlqs.py), each in front of one of eu's agents
RLQS_ENVOYS = (("envoy-eu-a", "agent-eu-1"), ("envoy-eu-b", "agent-eu-2"))


def _with_envoys(spec: ChaosSpec) -> None:
    spec.envoys = RLQS_ENVOYS


def _envoys_of(ctx: RunContext, agent: str) -> tuple[str, ...]:
    assert ctx.topo.envoys is not None, "the scenario runs Envoys (spec.envoys)"
    return tuple(e.name for e in ctx.topo.envoys.envoys if e.agent == agent)


def _stream_cut(ctx: RunContext, envoy: str) -> Nemesis:
    """The Envoy's link to its agent blackholed both ways: its quota stream (and RLS) hang."""
    assert ctx.topo.envoys is not None, "the scenario runs Envoys (spec.envoys)"
    e = ctx.topo.envoys.by_name(envoy)
    return Partition(e.proxy, target=e.proxy.name, recorder=ctx.history,
                     effects=Effects(envoys=(envoy,), grace_ms=ALLOCATOR_GRACE_MS))


def _agent_pause(ctx: RunContext, agent: str) -> Nemesis:
    """SIGSTOP an agent: its Envoys' streams hang (they keep enforcing what they hold)."""
    return Pause(ctx.topo.agent(agent).proc, recorder=ctx.history,
                 effects=Effects(envoys=_envoys_of(ctx, agent), grace_ms=ALLOCATOR_GRACE_MS))


def _agent_kill(ctx: RunContext, agent: str) -> Nemesis:
    """SIGKILL an agent, restarted at stop: its Envoys' streams break, a new process funds them again."""
    g = ctx.topo.agent(agent)
    return Kill(g.proc, ready=ctx.topo.ready_callback(g.url), recorder=ctx.history,
                effects=Effects(envoys=_envoys_of(ctx, agent), restarted_agents=(agent,), grace_ms=ALLOCATOR_GRACE_MS))


def _rlqs_faults(c: RunContext) -> list[Step]:
    """The stream, the agent (paused, killed: a restart takes seconds, so early enough that the
    Envoy is funded again before the run ends), then eu's allocators and, once eu has had
    ``FALLBACK_SHOWS_MS`` to answer from its regional fallback, its Redis too (both end together).
    The faults are placed relative to each other, so the seeds move them together (one group)."""
    gap = max(FALLBACK_SHOWS_MS / 1000, _at(c, 0.12))
    redis = max(3.0, _at(c, 0.10))
    cut = _at(c, 0.93) - gap - redis  # both end at 0.93 of the run (0.88 to 0.98 with the jitter)
    return [Step(_at(c, 0.10), _stream_cut(c, "envoy-eu-a"), _at(c, 0.12), group="rlqs"),
            Step(_at(c, 0.25), _agent_pause(c, "agent-eu-2"), _at(c, 0.09), group="rlqs"),
            Step(_at(c, 0.36), _agent_kill(c, "agent-eu-1"), _at(c, 0.06), group="rlqs"),
            Step(cut, _region_partition(c, "eu"), gap + redis, group="rlqs"),
            Step(cut + gap, _redis_partition(c, "eu"), redis, group="rlqs")]


def envoys_decided(ctx: RunContext) -> list[str]:
    """Every Envoy admitted requests and denied others itself (its quota filter), its access log
    holds every admission its clients saw, and it admitted again after its last cut-off ended
    (its stream came back and the agent funded it again)."""
    from .history import DecisionRec, Fault, read_history

    out = []
    if ctx.envoy_load is None:
        return ["no Envoy ran"]
    recs = list(read_history(ctx.history.path))
    ends: dict[str, int] = {}
    for f in recs:
        if isinstance(f, Fault) and f.stop_ms is not None:
            for e in f.envoys_cut_off:
                ends[e] = max(ends.get(e, 0), f.stop_ms)
    for name, logged in sorted(ctx.envoy_logged.items()):
        seen = ctx.envoy_load.stats.per_envoy[name]
        if logged["admitted"] == 0:
            out.append(f"{name} admitted nothing")
        if logged["deniedByQuota"] == 0:
            out.append(f"{name} never denied a request from its quota assignment")
        if logged["admitted"] < seen:
            out.append(f"{name}'s access log holds {logged['admitted']} admissions, its clients saw {seen}")
        if name in ends and not any(isinstance(d, DecisionRec) and d.gateway == name and d.allowed
                                    and (d.sent_at_ms or 0) > ends[name] for d in recs):
            out.append(f"{name} admitted nothing after its last cut-off ended")
    if not ctx.envoy_logged:
        out.append("no Envoy access log was read")
    return out


# ----------------------------------------------------------------------------- expectations
@dataclass(frozen=True)
class FallbackIn:
    """An expectation: decisions answered from the regional fallback allowance (the region cut off
    from the allocators, its Redis reachable) were observed in each of ``regions``. The scenario's
    schedule must cut each region off for ``FALLBACK_SHOWS_MS`` with its Redis reachable
    (tests/unit/chaos reads ``regions`` and checks every seed)."""

    regions: tuple[str, ...]

    def __call__(self, ctx: RunContext) -> list[str]:
        return [f"no fallback decision observed in {r}" for r in self.regions if ctx.load.stats[r].fallback == 0]


def fallback_in(*regions: str) -> FallbackIn:
    """:class:`FallbackIn` of ``regions``."""
    return FallbackIn(regions)


def local_in(*regions: str) -> Expect:
    """Decisions taken from local allowances (the agent's Redis unreachable) were observed."""
    def check(ctx: RunContext) -> list[str]:
        return [f"no local-allowance decision observed in {r}" for r in regions if ctx.load.stats[r].local == 0]
    return check


def leader_changed(ctx: RunContext) -> list[str]:
    nodes = {e for e, _n in ctx.leaders}
    return [] if len(nodes) >= 2 else [f"no leader change observed (epochs seen: {sorted(nodes)})"]


def faults_recorded(ctx: RunContext) -> list[str]:
    return [] if ctx.faults_recorded() > 0 else ["no fault record was written"]


def no_fallback(ctx: RunContext) -> list[str]:
    """Slow is not unreachable: no decision came from a fallback allowance."""
    return [f"{s.fallback} fallback decision(s) in {r}" for r, s in ctx.load.stats.items() if s.fallback]


def faketime_applied(service: str) -> Expect:
    """The service (an agent, allocator-N or redis-R) really runs under libfaketime (its
    environment carries the FAKETIME spec)."""
    def check(ctx: RunContext) -> list[str]:
        if service.startswith("redis-"):
            proc = ctx.topo.redis[service.removeprefix("redis-")].proc
        elif service.startswith("allocator-"):
            proc = next(a.proc for a in ctx.topo.allocators if a.name == service)
        else:
            proc = ctx.topo.agent(service).proc
        try:
            env = open(f"/proc/{proc.pid}/environ", "rb").read()  # type: ignore[union-attr]  # a running topology's processes are started
        except (OSError, AssertionError, AttributeError):
            return [f"{service} is not running at the end of the run"]
        return [] if b"FAKETIME=" in env else [f"{service} does not run under faketime"]
    return check


def errors_in(region: str) -> Expect:
    def check(ctx: RunContext) -> list[str]:
        return [] if ctx.load.stats[region].errors > 0 else [f"no failed request observed in {region}"]
    return check


def bundle_version(v_offset: int) -> Expect:
    def check(ctx: RunContext) -> list[str]:
        want = ctx.bundle.bundle_version + v_offset
        got = ctx.final_bundle_versions
        bad = {a: v for a, v in got.items() if v != want}
        return [f"agents not on policy v{want} at the end: {bad}"] if bad or not got else []
    return check


def replays_seen(ctx: RunContext) -> list[str]:
    st = ctx.driver_stats
    out = []
    if st is None or st.replays == 0:
        out.append("no lease request was replayed")
    elif st.replay_mismatches:
        out.append(f"{st.replay_mismatches} replayed lease id(s) answered with a different grant")
    return out


def stale_refused(ctx: RunContext) -> list[str]:
    st = ctx.driver_stats
    return [] if st is not None and st.stale_refused > 0 else ["no stale-epoch grant was replayed and refused"]


# ----------------------------------------------------------------------------- the catalogue
FAKETIME_KEYS = ("LD_PRELOAD", "FAKETIME", "FAKETIME_NO_CACHE", "DONT_FAKE_MONOTONIC")


def _faketime(spec: ChaosSpec, service: str, skew_s: float, rate: float | None = None) -> None:
    env = faketime_env(skew_s=skew_s, rate=rate)
    spec.env[service] = {k: env[k] for k in FAKETIME_KEYS}
    if rate is None:
        spec.clock_offsets_ms[service] = int(skew_s * 1000)


def _skew_agent(spec: ChaosSpec) -> None:
    _faketime(spec, "agent-us-1", 1.0, 1.02)


def _offset_allocators(skew_s: float) -> Callable[[ChaosSpec], None]:
    """Every allocator replica on one offset clock (so pool windows have one definition across a
    failover). The offset between Redis and the allocators is made on the allocators' side:
    redis-server 7 does not start under libfaketime 0.9.10 (its jemalloc calls clock_gettime while
    libfaketime initialises, which libfaketime refuses as recursion)."""
    def configure(spec: ChaosSpec) -> None:
        for i in range(spec.allocators):
            _faketime(spec, f"allocator-{i + 1}", skew_s)
    return configure


def _at(ctx: RunContext, frac: float) -> float:
    return frac * ctx.duration_s


SCENARIOS: dict[str, Scenario] = {}


def _add(s: Scenario) -> None:
    SCENARIOS[s.name] = s


_add(Scenario("partition-region-allocator", "eu's agents cannot reach either allocator (both directions blackholed)",
              lambda c: [Step(_at(c, 0.25), _region_partition(c, "eu"), _at(c, 0.4))],
              expect=[fallback_in("eu")]))
_add(Scenario("partition-regions-allocator", "both regions cut off from the allocators at once",
              lambda c: [Step(_at(c, 0.25), Combined2(c, _region_partition(c, "eu"), _region_partition(c, "us")),
                              _at(c, 0.4))],
              expect=[fallback_in("eu", "us")]))
_add(Scenario("one-way-loss-latency", "us->allocator requests blackholed one way while eu's links get 80±40 ms",
              lambda c: [Step(_at(c, 0.2), Combined2(c, *[_rec(Latency(p, 80, 40, target=p.name), c)
                                                           for p in c.topo.region_links["eu"]]), _at(c, 0.6)),
                         Step(_at(c, 0.3), _region_partition(c, "us", "up"), _at(c, 0.3))],
              expect=[fallback_in("us")]))
_add(Scenario("partition-allocator-etcd", "the allocator leader loses every etcd connection",
              lambda c: [Step(_at(c, 0.25), LeaderEtcdPartition(c), _at(c, 0.35))],
              expect=[leader_changed]))
_add(Scenario("etcd-member-isolate", "one etcd member cut off from its peers (iptables, cgroup-scoped)",
              lambda c: [Step(_at(c, 0.25), _rec(EtcdMemberIsolate(c.topo.etcd, 0, effects=_all_regions(c)), c),
                              _at(c, 0.4))],
              expect=[faults_recorded]))
_add(Scenario("partition-agent-redis", "eu's agents cannot reach their Redis",
              lambda c: [Step(_at(c, 0.3), _redis_partition(c, "eu"), _at(c, 0.25))],
              expect=[local_in("eu")]))
_add(Scenario("kill-leader", "SIGKILL the allocator leader, restart it later",
              lambda c: [Step(_at(c, 0.3), LeaderKill(c), _at(c, 0.3))],
              expect=[leader_changed]))
_add(Scenario("pause-leader", "SIGSTOP the allocator leader, SIGCONT it after longer than its election TTL",
              lambda c: [Step(_at(c, 0.3), LeaderPause(c), max(4.0, _at(c, 0.2)))],
              expect=[leader_changed]))
_add(Scenario("redis-restart", "eu's Redis SIGKILLed and restarted empty (state and script cache lost) while "
              "leases are held", lambda c: [Step(_at(c, 0.3), _redis_restart(c, "eu"), 3.0)],
              expect=[local_in("eu")]))
_add(Scenario("redis-restart-both", "both regions' Redis SIGKILLed at once and restarted empty",
              lambda c: [Step(_at(c, 0.3), _both(c, _redis_restart), 3.0)],
              expect=[local_in("eu", "us")]))
_add(Scenario("redis-pause", "eu's Redis SIGSTOPped while leases are held (connections hang), then SIGCONT",
              lambda c: [Step(_at(c, 0.3), _redis_pause(c, "eu"), max(4.0, _at(c, 0.2)))],
              expect=[local_in("eu")]))
_add(Scenario("redis-cluster-pause", "eu's Redis is a 3-primary Redis Cluster; the primary owning atlas's slot is "
              "SIGSTOPped under load, then SIGCONT: only atlas degrades (per-shard breakers), birch, cedar and dune "
              "see no fallback and no 503",
              lambda c: [Step(_at(c, 0.3), ClusterPrimaryFault(c, CLUSTER_REGION, CLUSTER_TENANT), max(4.0, _at(c, 0.3)))],
              configure=_on_cluster,
              expect=[shard_isolated(CLUSTER_REGION, CLUSTER_TENANT, OTHER_SHARD_TENANTS)]))
_add(Scenario("redis-cluster-failover", "eu's Redis Cluster primary owning atlas's slot (with a replica) is "
              "SIGKILLed under load: the cluster promotes the replica, the agents find it and serve atlas from it "
              "(its leased balances of the old incarnation count as fully spent); the killed node rejoins later",
              lambda c: [Step(_at(c, 0.25), ClusterPrimaryFault(c, CLUSTER_REGION, CLUSTER_TENANT, kill=True),
                              max(8.0, _at(c, 0.5)))],
              configure=_on_cluster_with_replica,
              expect=[shard_isolated(CLUSTER_REGION, CLUSTER_TENANT, OTHER_SHARD_TENANTS, served_again=True)]))
_add(Scenario("redis-pause-both", "both regions' Redis SIGSTOPped at once, then SIGCONT",
              lambda c: [Step(_at(c, 0.3), _both(c, _redis_pause), max(4.0, _at(c, 0.2)))],
              expect=[local_in("eu", "us")]))
_add(Scenario("agent-kill", "one of eu's two agents SIGKILLed and restarted",
              lambda c: [Step(_at(c, 0.3), _rec(Kill(c.topo.agent("agent-eu-1").proc,
                                                     ready=c.topo.ready_callback(c.topo.agent("agent-eu-1").url),
                                                     effects=Effects(restarted_agents=("agent-eu-1",))), c),
                              _at(c, 0.2))],
              expect=[errors_in("eu")]))
_add(Scenario("allocator-latency", "every agent<->allocator link delayed 25-150 ms each way (50-300 ms per round "
              "trip), no loss: slow is not unreachable, no admission may come from a fallback allowance",
              lambda c: [Step(_at(c, 0.15), Combined2(c, *[_rec(Latency(p, 87.5, 62.5, target=p.name), c)
                                                            for r in c.topo.spec.regions
                                                            for p in c.topo.region_links[r]]), _at(c, 0.7))],
              expect=[faults_recorded, no_fallback]))
_add(Scenario("clock-offset-allocator-ahead", "both allocators run 2 s ahead of Redis, the agents and the recorder "
              "(faketime); eu cut off from the allocators for a while, so its regional fallback window (Redis clock) "
              "is counted against pool windows on another clock",
              lambda c: [Step(_at(c, 0.3), _region_partition(c, "eu"), _at(c, 0.4))],
              configure=_offset_allocators(2.0), expect=[fallback_in("eu"), faketime_applied("allocator-1")]))
_add(Scenario("clock-offset-allocator-behind", "both allocators run 2 s behind Redis, the agents and the recorder "
              "(faketime); us cut off from the allocators for a while",
              lambda c: [Step(_at(c, 0.3), _region_partition(c, "us"), _at(c, 0.4))],
              configure=_offset_allocators(-2.0), expect=[fallback_in("us"), faketime_applied("allocator-2")]))
_add(Scenario("clock-skew-agent", "agent-us-1 runs under faketime +1 s and a 2% fast clock; its allocator links "
              "get 50±50 ms", lambda c: [Step(_at(c, 0.2), Combined2(c, *[_rec(Latency(p, 50, 50, target=p.name), c)
                                                                           for p in c.topo.region_links["us"]]),
                                             _at(c, 0.5))],
              configure=_skew_agent, expect=[faults_recorded, faketime_applied("agent-us-1")]))
_add(Scenario("lease-replay", "duplicated and delayed lease requests (replayed lease ids) while the leader is "
              "killed: replays across the failover bring stale-epoch grants back",
              lambda c: [Step(_at(c, 0.3), LeaderKill(c), _at(c, 0.3)),
                         Step(_at(c, 0.75), _replay_stale(c), 0)],
              lease_driver=True, expect=[replays_seen, leader_changed, stale_refused]))
_add(Scenario("allocator-rebalance", "three allocator replicas lead 64 shards; a fourth joins during load and "
              "later leaves, then one of the three leaves and joins again: shards are handed off and back",
              _rebalance, configure=_sharded, expect=[shards_rebalanced]))
_add(Scenario("rlqs-envoys", "two Envoys on the shipped envoy-rlqs.yaml in front of eu's agents decide locally "
              "from RLQS quota assignments: envoy-eu-a's stream blackholed, agent-eu-2 SIGSTOPped, "
              "agent-eu-1 SIGKILLed and restarted, eu cut off from the allocators, then from its Redis; Envoy-side admissions (their "
              "access logs) judged with the bound's RLQS term", _rlqs_faults, configure=_with_envoys,
              expect=[envoys_decided, fallback_in("eu"), local_in("eu")]))
_add(Scenario("rlqs-envoys-steady", "rlqs-envoys' two Envoys, load and pools with no fault at all: what RLQS "
              "costs in utilisation when nothing fails, every window judged. Not in the profile: each Envoy "
              "bucket's unspent tokens are stranded, and this scenario fails the utilisation floor "
              "(chaos/README.md, 'RLQS pools when nothing fails')", lambda c: [], configure=_with_envoys,
              expect=[envoys_decided], profiled=False))
_add(Scenario("policy-rollback", "a tightened bundle (G halved) published mid-run through etcd, then the old "
              "content published as a higher version", _policy_rollback, expect=[bundle_version(2)]))


class Combined2(Nemesis):
    """Like :class:`chaos.nemesis.Combined` but recorded once under the run's history."""

    name = "combined"

    def __init__(self, ctx: RunContext, *parts: Nemesis):
        from .nemesis import NO_EFFECTS

        super().__init__("+".join(p.target for p in parts), recorder=ctx.history,
                         detail=" + ".join(f"{p.name}:{p.detail}".rstrip(":") for p in parts),
                         effects=sum((p.effects for p in parts), NO_EFFECTS))
        self.parts = parts
        for p in parts:
            p.recorder = None

    async def _start(self) -> None:
        for p in self.parts:
            await p.start()

    async def _stop(self) -> None:
        results = await asyncio.gather(*[p.stop() for p in reversed(self.parts)], return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


PROFILES: dict[str, list[tuple[str, float]]] = {
    # (scenario, duration s); make chaos runs "full" with 3 seeds. Every run has two agents per region
    # and the global-scope pool fleet-g beside the tenant pools (chaos/topo.py, chaos/bundles.py).
    "short": [("partition-region-allocator", 24.0), ("kill-leader", 24.0), ("redis-restart", 20.0),
              ("lease-replay", 24.0), ("policy-rollback", 20.0), ("redis-cluster-pause", 20.0)],
    "full": [(name, 60.0) for name, s in SCENARIOS.items() if s.profiled] + [("kill-leader+partition-region-allocator", 60.0),
                                                   ("redis-restart+pause-leader", 60.0)],
}


def resolve(name: str) -> list[Scenario]:
    """``a+b`` -> [a, b] (combined: their schedules run together)."""
    parts = [p.strip() for p in name.split("+") if p.strip()]
    if not parts:
        raise BadRequest("empty scenario name")
    unknown = [p for p in parts if p not in SCENARIOS]
    if unknown:
        raise BadRequest(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    return [SCENARIOS[p] for p in parts]
