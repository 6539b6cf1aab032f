"""Lease and degradation tests against whole real topologies: etcd, allocator processes, and
two regions each with its own redis-server and region agent process (``leasehold.local.topology``).

Bundles here use short pool windows (seconds) so a test sees several windows quickly. Every
admission is recorded with the wall-clock times it was sent and answered: the allocator's
windows and the Redis clock that times leases are both on this machine's wall clock, so a
decision whose send and answer fall in the same window ``k`` was decided (and its lease
tokens spent) in window ``k``. Decisions that straddle a boundary are kept apart as ambiguous.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from redis.asyncio import Redis

from allocator.allocation import WindowState
from allocator.records import GrantRecord
from kernel.bundle import Fallback, Rule, make_rule
from kernel.etcd_store import EtcdStore
from leasehold.local.procs import Proc
from leasehold.local.services import agent_command
from leasehold.local.topology import LocalTopology, TopologySpec
from region_agent.decision.keys import KeyBuilder
from region_agent.store.scripts import Scripts
from tests.support.agent import admit_body

PREFIX = "/leasehold/"  # the allocator's default etcd prefix
FAST_AGENT = ("--lease-tick-ms", "50", "--allocator-timeout-ms", "300", "--allocator-deadline-ms", "900",
              "--decision-budget-ms", "250", "--policy-poll-ms", "0", "--log-level", "warning")
FAST_ALLOCATOR = ("--election-ttl-s", "2", "--log-level", "warning")
# FAST_AGENT's allocator bounds (300 ms per attempt, 900 ms per lease request) find a blackholed
# allocator quickly, and the default cold-lease wait (600 ms beyond the decision budget) lets a cold
# balance's first request wait for its first lease; all three are shorter than one allocator round
# trip on a loaded machine (a CI run beside a busy core saw an etcd transaction make it 1.12 s). A test
# whose subject is not a slow or unreachable allocator gives its agents this room, so that a slow
# round trip is not taken for an unreachable allocator (the fallback allowance, or a 503 for a closed
# rule) nor a first request denied as pool-busy
ALLOCATOR_ROOM = ("--cold-lease-wait-ms", "5000", "--allocator-timeout-ms", "4000", "--allocator-deadline-ms", "4500")


def wall_ms() -> int:
    return int(time.time() * 1000)


def pool_rule(tenant: str, pool: str, fail_mode: str = "local_bounded") -> Rule:
    return make_rule(id=f"tenant-{tenant}-pool", scope="tenant", tenant=tenant, algorithm="pool", pool=pool, cost=1,
                fail_mode=fail_mode)


def user_rule() -> Rule:
    """A generous per-user bucket with a small local fallback (so Redis loss has a stated bound)."""
    return make_rule(id="user-all", scope="user", algorithm="token_bucket", capacity_millis=1_000_000,
                refill_millis=1_000_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded",
                fallback=Fallback(capacity_millis=3_000, refill_millis=1, period_ms=60_000))


def start_topology(run_dir: Path, policy: Path, *, agent_args: tuple[str, ...] = (),
                   regions: tuple[str, ...] = ("eu", "us"), agents_per_region: int = 1) -> LocalTopology:
    spec = TopologySpec(run_dir=run_dir, policy=policy, regions=regions, agents_per_region=agents_per_region,
                        allocators=2, agent_args=FAST_AGENT + agent_args, allocator_args=FAST_ALLOCATOR)
    return LocalTopology(spec).start(timeout=60)


@pytest.fixture
def topology_factory(tmp_path: Path) -> Iterator:
    started: list[LocalTopology] = []

    def make(policy: Path, **kw) -> LocalTopology:
        topo = start_topology(tmp_path / f"topo-{len(started)}", policy, **kw)
        started.append(topo)
        return topo

    yield make
    for topo in started:
        topo.stop()


# ------------------------------------------------------------------------------ recording load
@dataclass(frozen=True)
class Record:
    region: str
    sent_ms: int
    recv_ms: int
    status: int
    d: dict

    @property
    def zone(self) -> str:
        """The region of the agent that decided (labels like ``eu#2`` name a region's second agent)."""
        return self.region.split("#", 1)[0]

    @property
    def allowed(self) -> bool:
        return bool(self.d.get("allowed"))

    @property
    def fallback(self) -> bool:
        return bool(self.d.get("fallback"))

    def window(self, window_ms: int) -> int | None:
        """The window this decision certainly fell in, or None when it straddles a boundary."""
        k = self.sent_ms // window_ms
        return k if self.recv_ms // window_ms == k else None


async def admit(client: httpx.AsyncClient, url: str, region: str, body: dict) -> Record:
    sent = wall_ms()
    resp = await client.post(url + "/v1/admit", json=body)
    recv = wall_ms()
    assert resp.status_code == 200, resp.text  # a decision, never a 5xx from the agent itself
    return Record(region, sent, recv, resp.status_code, resp.json())


async def drive(urls: dict[str, str], tenant: str, *, seconds: float, per_second: dict[str, float],
                workers: int = 2, stop: asyncio.Event | None = None) -> list[Record]:
    """Send admissions for ``tenant`` to each region's agent at about ``per_second[region]``
    (bounded: at most ``seconds`` of load), recording every decision."""
    out: list[Record] = []
    end = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient, region: str, url: str, interval: float) -> None:
        nxt = time.monotonic()
        while time.monotonic() < end and not (stop and stop.is_set()):
            out.append(await admit(client, url, region, admit_body(tenant=tenant, pid=f"U-{len(out) % 7}")))
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async with httpx.AsyncClient(timeout=10) as client:
        tasks = [worker(client, region, url, workers / per_second[region])
                 for region, url in urls.items() if per_second.get(region, 0) > 0 for _ in range(workers)]
        await asyncio.gather(*tasks)
    return out


def per_window(records: list[Record], window_ms: int, *, allowed: bool = True, fallback: bool | None = None,
               region: str | None = None) -> Counter:
    """Count decisions per certain window (boundary-straddling ones left out)."""
    c: Counter = Counter()
    for r in records:
        if r.allowed != allowed or (fallback is not None and r.fallback != fallback):
            continue
        if region is not None and r.zone != region:
            continue
        k = r.window(window_ms)
        if k is not None:
            c[k] += 1
    return c


def full_windows(records: list[Record], window_ms: int) -> list[int]:
    """Windows that the load covered from start to end."""
    first = min(r.sent_ms for r in records)
    last = max(r.recv_ms for r in records)
    return list(range(first // window_ms + 1, last // window_ms))


# ------------------------------------------------------------------------------ reading etcd / allocators
async def etcd_windows(topo: LocalTopology, pool: str) -> dict[int, WindowState]:
    assert topo.etcd is not None
    store = EtcdStore(topo.etcd.endpoints, timeout_s=5.0)
    try:
        kvs = await store.get_prefix(f"{PREFIX}pools/{pool}/".encode())
    finally:
        await store.close()
    return {int(kv.key.rsplit(b"/", 1)[1]): msgspec.json.decode(kv.value, type=WindowState) for kv in kvs}


async def etcd_grants(topo: LocalTopology) -> dict[str, GrantRecord]:
    assert topo.etcd is not None
    store = EtcdStore(topo.etcd.endpoints, timeout_s=5.0)
    try:
        kvs = await store.get_prefix(f"{PREFIX}grants/".encode())
    finally:
        await store.close()
    return {kv.key.rsplit(b"/", 1)[1].decode(): msgspec.json.decode(kv.value, type=GrantRecord) for kv in kvs}


async def leader_url(topo: LocalTopology, within_s: float = 20.0) -> str:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            for url in topo.allocator_urls:
                try:
                    info = (await client.get(url + "/v1/leader")).json()
                except (httpx.HTTPError, ValueError):
                    continue
                if info.get("isSelf"):
                    return url
            await asyncio.sleep(0.1)
    raise AssertionError("no allocator leader")


def restart(proc: Proc) -> None:
    proc.start()  # same arguments, same port


def agent_urls(topo: LocalTopology, every: bool = False) -> dict[str, str]:
    """One agent per region (``eu``), or with ``every`` each agent labelled ``eu``, ``eu#2``, ..."""
    if not every:
        return {region: urls[0] for region, urls in topo.agent_urls.items()}
    return {region if i == 0 else f"{region}#{i + 1}": url
            for region, urls in topo.agent_urls.items() for i, url in enumerate(urls)}


async def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample's values over series matching ``labels``."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(url + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


# ------------------------------------------------------------------------------ agents behind a fault proxy
@dataclass
class ProxiedRegion:
    """etcd + allocator(s), one fault proxy (``chaos.proxy``, a real TCP proxy process) in front of
    the first allocator, and region ``eu``: a redis-server and agent processes that reach the
    allocator only through the proxy (so a test can add latency or blackhole that link)."""

    allocators: LocalTopology
    proxy: object  # chaos.proxy.ProxyProcess
    region: LocalTopology

    @property
    def agents(self) -> list[str]:
        return self.region.agent_urls["eu"]

    @property
    def allocator_url(self) -> str:
        return self.allocators.allocator_urls[0]

    def stop(self) -> None:
        self.region.stop()
        self.proxy.stop()  # type: ignore[attr-defined]  # the proxy is a leasehold.local.procs process, typed object here
        self.allocators.stop()


def start_proxied_region(run_dir: Path, policy: Path, *, agents: int = 1, agent_args: tuple[str, ...] = (),
                         fast: tuple[str, ...] = FAST_AGENT, latency_ms: float = 0.0) -> ProxiedRegion:
    from chaos.proxy import ProxyProcess
    from leasehold.local.procs import LOOPBACK

    allocs = LocalTopology(TopologySpec(run_dir=run_dir / "alloc", policy=policy, regions=(), allocators=1,
                                   allocator_args=FAST_ALLOCATOR)).start(timeout=60)
    proxy = None
    try:
        port = int(allocs.allocator_urls[0].rsplit(":", 1)[1])
        proxy = ProxyProcess((LOOPBACK, port), run_dir / "proxy").start()
        if latency_ms:
            asyncio.run(proxy.control.latency(latency_ms / 2))  # each direction: a round trip adds latency_ms
        region = LocalTopology(TopologySpec(
            run_dir=run_dir / "region", policy=policy, regions=("eu",), agents_per_region=agents,
            with_allocator=False, agent_args=fast + ("--allocator-urls", f"http://{LOOPBACK}:{proxy.port}")
            + agent_args)).start(timeout=60)
    except BaseException:
        if proxy is not None:
            proxy.stop()
        allocs.stop()
        raise
    return ProxiedRegion(allocs, proxy, region)


async def request_lease(allocator_url: str, pool: str, want: int, region: str = "eu") -> dict:
    """A lease straight from the allocator, as a region's lease client asks for one."""
    body = {"leaseId": f"{region}-test-{uuid.uuid4().hex[:16]}", "region": region, "pool": pool, "want": want}
    async with httpx.AsyncClient(timeout=10) as client:
        resp = await client.post(allocator_url + "/v1/leases", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def start_agent(workdir: Path, policy: Path, redis_url: str, allocator_url: str | None, *extra: str,
                fast: tuple[str, ...] = FAST_AGENT, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """One region agent process of region ``eu``; returns (process, base URL) once it is ready."""

    from leasehold.local.procs import LOOPBACK, free_port, wait_http_ready
    from leasehold.local.topology import DEV_PEPPER, _env

    port = free_port()
    args = agent_command(*fast, *extra, redis_url=redis_url, policy=policy, region="eu", host=LOOPBACK, port=port,
                         auth_disabled=True)
    if allocator_url:
        args += ["--allocator-urls", allocator_url]
    proc = Proc(f"agent-eu-{port}", args, workdir, env=_env(LEASEHOLD_AGENT_PEPPER=DEV_PEPPER, **(env or {}))).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http_ready({url: proc}, timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


@functools.cache
def _scripts() -> Scripts:
    """The scripts, loaded once per test process: loading them reads every ``lua/`` file and
    registers each lean variant (80 ms of CPU beside stress-ng --cpu 2), which a reading of a
    balance timed against a window's edge cannot afford each time."""
    return Scripts()


async def spendable(redis_url: str, tenant: str, pool: str, for_ms: int = 600, client: Redis | None = None) -> int:
    """What a region's leased balance of ``tenant``'s pool really holds (its Redis, as the script
    reads it) in leases that stay valid ``for_ms`` more. ``client``: an open connection to that
    Redis to read with (else one is opened for this reading)."""
    r = client if client is not None else Redis.from_url(redis_url)
    try:
        bal = await _scripts().pool_balance(r, KeyBuilder.tenant_pool_key(tenant, pool))
    finally:
        if client is None:
            await r.aclose()
    return sum(e.granted - e.spent for e in bal.entries.values()
               if e.valid_at(bal.now_ms, bal.incarnation) and e.expires_at_ms - bal.now_ms >= for_ms)
