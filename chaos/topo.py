"""The chaos topology: the services of :mod:`leasehold.local.topology`, but every inter-component
link through a fault proxy, with per-service argv prefixes and environments (libfaketime).

* a 3-member etcd cluster (:class:`leasehold.local.procs.EtcdCluster`);
* allocator replicas, each reaching every etcd member through its own proxy
  (``etcd<-alloc-N/mK``), so one allocator can be cut off from etcd;
* regions, each with its own redis-server, reached by each agent through a proxy
  (``redis<-agent-R-J``), and each agent reaching every allocator replica through a proxy of
  its region (``alloc-N<-R``) — a region<->allocator partition blackholes the region's links;
* or, for the regions in ``redis_cluster``, a 3-primary Redis Cluster (``cluster-require-full-coverage
  no``, a replica for each primary index in ``redis_cluster_replicas``) that the agents reach
  directly (a cluster names its nodes' own addresses in its slot map and redirects: a proxy in
  between would be bypassed). Its faults are on the processes (pause, kill).

Everything is a real process on loopback, stopped by PID in :meth:`ChaosTopology.stop` (also
when start-up fails); the proxies run in one child process (:class:`chaos.proxyhost.ProxyHost`), so a
stall of the runner is not a stall of every link.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kernel.etcd_store import EtcdStore
from leasehold.local.procs import (
    LOOPBACK,
    EtcdCluster,
    Proc,
    RedisCluster,
    RedisServer,
    free_port,
    wait_http_ready,
    wait_port,
)
from leasehold.local.services import agent_command, allocator_command

from .etcd_records import read_leaders
from .history import Leader
from .proxyhost import HostedProxy, ProxyHost

PREFIX = "/leasehold/"
# the allocator timeout per attempt is the product default (500 ms): above the 50-300 ms round trips the
# allocator-latency scenario injects (slow is not unreachable); the deadline of all attempts is shorter
# than the default (3 s) so a partition shows within a short run
AGENT_SETTINGS = dict(lease_tick_ms=50, allocator_timeout_ms=500, allocator_deadline_ms=1500, decision_budget_ms=250,
                      policy_poll_ms=0, log_level="warning", insecure_dev_pepper=True, breaker_open_ms=500,
                      redis_socket_timeout_ms=300)
ALLOCATOR_SETTINGS = dict(election_ttl_s=2, log_level="warning", etcd_timeout_ms=800)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # local runs: no credentials between our own processes (a build without auth ignores these)
    env.setdefault("LEASEHOLD_AGENT_AUTH_DISABLED", "true")
    env.setdefault("LEASEHOLD_ALLOCATOR_AUTH_DISABLED", "true")
    env.update(extra)
    return env


@dataclass
class ChaosSpec:
    run_dir: Path
    policy: Path
    regions: tuple[str, ...] = ("eu", "us")
    agents: dict[str, int] = field(default_factory=lambda: {"eu": 2, "us": 2})  # agents share the region's Redis
    allocators: int = 2
    standby_allocators: int = 0  # replicas with ports and proxies but started only by a join nemesis
    shards: int = 1  # allocator --shards (1: one leader for every pool)
    etcd_members: int = 3
    prefix: dict[str, list[str]] = field(default_factory=dict)  # service name -> argv prefix
    # service name -> extra environment, e.g. libfaketime's LD_PRELOAD + FAKETIME (the process keeps
    # its own PID, unlike the ``faketime`` wrapper, which forks: stopping it would orphan the service)
    env: dict[str, dict[str, str]] = field(default_factory=dict)  # keys: allocator-N, agent-R-J, redis-R
    clock_offsets_ms: dict[str, int] = field(default_factory=dict)  # service name -> its clock - the real clock
    agent_args: tuple[str, ...] = ()
    allocator_args: tuple[str, ...] = ()
    policy_etcd: bool = True  # agents follow the policy key in etcd (for mid-run publication)
    seed: int = 0
    redis_cluster: tuple[str, ...] = ()  # regions whose Redis is a 3-primary Redis Cluster
    redis_cluster_replicas: tuple[int, ...] = ()  # primary indexes that get a replica (failover)


@dataclass
class Agent:
    name: str
    region: str
    proc: Proc
    url: str
    port: int
    redis_proxy: HostedProxy | None  # None: the region's Redis is a cluster, reached directly
    alloc_proxies: list[HostedProxy]


@dataclass
class Allocator:
    name: str
    node_id: str
    proc: Proc
    url: str
    port: int
    etcd_proxies: list[HostedProxy]


class ChaosTopology:
    def __init__(self, spec: ChaosSpec):
        self.spec = spec
        self.etcd: EtcdCluster | None = None
        self.host: ProxyHost | None = None
        self.allocators: list[Allocator] = []
        self.redis: dict[str, RedisServer] = {}
        self.clusters: dict[str, RedisCluster] = {}  # regions on a Redis Cluster
        self.agents: list[Agent] = []
        # region -> one proxy per allocator replica (shared by the region's agents)
        self.region_links: dict[str, list[HostedProxy]] = {}

    # ------------------------------------------------------------------ start/stop
    def start(self, timeout: float = 90.0) -> ChaosTopology:
        s, run = self.spec, self.spec.run_dir
        run.mkdir(parents=True, exist_ok=True)
        try:
            self.host = ProxyHost(run / "proxies")
            self.etcd = EtcdCluster(run / "etcd", members=s.etcd_members).start(timeout)
            for i in range(s.allocators + s.standby_allocators):
                name, port = f"allocator-{i + 1}", free_port()
                proxies = [self.host.add(f"etcd{k}<-{name}", p, seed=s.seed) for k, p in enumerate(self.etcd.client_ports)]
                url = f"http://{LOOPBACK}:{port}"
                sharding = {"shards": s.shards} if s.shards > 1 else {}
                args = [*s.prefix.get(name, []), *allocator_command(
                    *s.allocator_args, etcd=[p.url_host for p in proxies], policy=s.policy, node_id=f"alloc-{i + 1}",
                    host=LOOPBACK, port=port, advertise_url=url, **ALLOCATOR_SETTINGS, **sharding)]
                proc = Proc(name, args, run / name, env=child_env(**s.env.get(name, {})))
                if i < s.allocators:
                    proc.start()
                self.allocators.append(Allocator(name, f"alloc-{i + 1}", proc, url, port, proxies))
            for a in self.allocators:
                if a.proc.popen is not None:
                    wait_port(a.port, proc=a.proc.popen, timeout=timeout)
            for region in s.regions:
                env = s.env.get(f"redis-{region}")
                if region in s.redis_cluster:
                    self.clusters[region] = RedisCluster(run / f"redis-{region}", full_coverage=False,
                                                         node_timeout_ms=1000,
                                                         replicas_of=s.redis_cluster_replicas).start(timeout)
                else:
                    self.redis[region] = RedisServer(run / f"redis-{region}", env=child_env(**env) if env else None
                                                     ).start(timeout)
                self.region_links[region] = [self.host.add(f"{a.name}<-{region}", a.port, seed=s.seed)
                                             for a in self.allocators]
                for j in range(s.agents.get(region, 1)):
                    self.agents.append(self._start_agent(region, j))
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_agent(self, region: str, j: int) -> Agent:
        s = self.spec
        assert self.host is not None and self.etcd is not None
        name, port = f"agent-{region}-{j + 1}", free_port()
        rproxy: HostedProxy | None = None
        if region in self.clusters:
            redis_url = "redis+cluster://" + ",".join(f"{LOOPBACK}:{n.port}" for n in self.clusters[region].nodes)
        else:
            rproxy = self.host.add(f"redis-{region}<-{name}", self.redis[region].port, seed=s.seed)
            redis_url = f"redis://{rproxy.url_host}/0"
        links = self.region_links[region]
        etcd = dict(policy_etcd=self.etcd.endpoints, policy_etcd_reread_ms=1000) if s.policy_etcd else {}
        args = [*s.prefix.get(name, []), *agent_command(
            *s.agent_args, redis_url=redis_url, policy=s.policy, region=region, host=LOOPBACK,
            port=port, allocator_urls=[f"http://{p.url_host}" for p in links], **AGENT_SETTINGS, **etcd)]
        proc = Proc(name, args, s.run_dir / name, env=child_env(**s.env.get(name, {}))).start()
        return Agent(name, region, proc, f"http://{LOOPBACK}:{port}", port, rproxy, links)

    def wait_ready(self, timeout: float = 60.0, procs: list[tuple[str, Proc]] | None = None) -> None:
        pending = dict(procs) if procs is not None else {
            **{a.url: a.proc for a in self.allocators if a.proc.popen is not None},
            **{g.url: g.proc for g in self.agents}}
        wait_http_ready(pending, timeout)

    def ready_callback(self, url: str):
        """A :class:`chaos.nemesis.Kill` ``ready`` hook: wait for the restarted service's /readyz."""

        def ready(proc: Proc) -> None:
            self.wait_ready(60.0, [(url, proc)])

        return ready

    def stop(self) -> None:
        for g in self.agents:
            g.proc.stop()
        for a in self.allocators:
            a.proc.stop()
        for r in self.redis.values():
            r.stop()
        for c in self.clusters.values():
            c.stop()
        if self.etcd is not None:
            self.etcd.stop()
        if self.host is not None:
            self.host.stop()

    # ------------------------------------------------------------------ queries
    def allocator_by_node(self, node: str | None) -> Allocator | None:
        return next((a for a in self.allocators if a.node_id == node), None)

    def agents_in(self, region: str) -> list[Agent]:
        return [g for g in self.agents if g.region == region]

    def agent(self, name: str) -> Agent:
        return next(g for g in self.agents if g.name == name)

    async def leader_state(self, store: EtcdStore | None = None) -> list[Leader] | None:
        """Every shard's allocator leader (one record when unsharded; empty: no leader key), read
        directly from etcd (not via proxies; through ``store`` when given, e.g. a watcher's own
        client); None when etcd has no quorum right now."""
        assert self.etcd is not None
        own = store is None
        store = store or EtcdStore(self.etcd.endpoints, timeout_s=2.0)
        try:
            return await read_leaders(store, PREFIX)
        except Exception:  # noqa: BLE001 - no quorum right now: unknown
            return None
        finally:
            if own:
                await store.close()

    async def leaders(self, store: EtcdStore | None = None) -> list[Leader]:
        """:meth:`leader_state`, empty when unknown."""
        return await self.leader_state(store) or []

    async def leader(self) -> tuple[int, str | None] | None:
        """(epoch, node id) of the allocator leader (sharded: of shard 0, as ``GET /v1/leader``)."""
        return next(((r.epoch, r.node) for r in await self.leaders() if r.shard == 0), None)

    async def wait_leader(self, timeout_s: float = 15.0) -> tuple[int, str | None] | None:
        """The leader (of shard 0) once elected; sharded, once every shard is led by the running
        replica the assignment gives it (the start-up handoffs are over)."""
        from allocator.shards import assignment

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leaders = await self.leaders()
            cur = next(((r.epoch, r.node) for r in leaders if r.shard == 0), None)
            want = assignment(self.spec.shards, {a.node_id for a in self.allocators if a.proc.alive()})
            settled = self.spec.shards == 1 or {r.shard: r.node for r in leaders} == want
            if cur is not None and cur[1] is not None and settled:
                return cur
            await asyncio.sleep(0.2)
        return None
