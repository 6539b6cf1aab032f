"""The chaos load generator: gateways of each region asking their agents ``/v1/admit`` for
several tenants, users and route groups, every answer recorded as a history ``decision``
(:func:`chaos.recording.decision_from_admit`). Bounded in requests and time.

Also polls every agent's ``GET /v1/leases`` and records each lease it holds once as a
``grant`` record (``source=region``, no receipt time: the poll sees it after the fact), so
the checker can match what regions hold against etcd.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kernel.bundle import Bundle

from .history import Counters, Grant, HistoryWriter, now_ms
from .recording import decision_from_admit

MAX_REQUESTS = 200_000
ROUTES = ("read", "write", "search")


async def run_workers(workers: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run the load's workers together until each returns; whatever ends the run (an error,
    a cancellation) cancels the others and waits for them, so no worker outlives it."""
    tasks = [asyncio.create_task(w) for w in workers]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def paced(interval_s: float, deadline: float, budget: list[int], rng: random.Random,
                stopped: Callable[[], bool] = lambda: False) -> AsyncIterator[None]:
    """One worker's request times: every ``interval_s`` (the first at a random offset within one
    interval, so workers spread out), no catch-up bursts after a stall; each time taken from the
    workers' shared ``budget``. Ends at ``deadline`` (``time.monotonic()``), when the budget is
    spent or once ``stopped()``."""
    next_at = time.monotonic() + rng.uniform(0, interval_s)
    while not stopped() and budget[0] > 0:
        now = time.monotonic()
        if now >= deadline:
            return
        if next_at > now:
            await asyncio.sleep(min(next_at - now, deadline - now))
            continue
        next_at = max(next_at + interval_s, time.monotonic() - interval_s)  # no catch-up bursts
        budget[0] -= 1
        yield


@dataclass(frozen=True)
class TenantLoad:
    tenant: str
    per_second: float  # per region
    users: int = 8
    routes: tuple[str, ...] = ROUTES


#: atlas and birch press their tenant pools; every tenant's search requests and all of dune's press the
#: global pool fleet-g (demand about 2.4 x G), so an in-process chunk carried past its window would show
DEFAULT_LOAD = (TenantLoad("atlas", 40.0), TenantLoad("birch", 12.0), TenantLoad("cedar", 6.0),
                TenantLoad("dune", 10.0, routes=("search",)))


@dataclass
class RegionStats:
    sent: int = 0
    allowed: int = 0
    denied: int = 0
    fallback: int = 0
    local: int = 0
    errors: int = 0
    per_agent: Counter = field(default_factory=Counter)
    errors_by_tenant: Counter = field(default_factory=Counter)  # requests without a decision, per tenant


@dataclass
class LoadGen:
    bundle: Bundle
    agents: Callable[[str], Sequence[tuple[str, str]]]  # region -> [(agent name, url)]
    regions: Sequence[str]
    history: HistoryWriter
    is_local: Callable[[str, int], bool] = lambda region, ms: False  # Redis known down at that time
    load: Sequence[TenantLoad] = DEFAULT_LOAD
    seed: int = 0
    timeout_s: float = 2.0
    stats: dict[str, RegionStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stats = {r: RegionStats() for r in self.regions}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self, duration_s: float, max_requests: int = 50_000) -> dict[str, RegionStats]:
        max_requests = min(max_requests, MAX_REQUESTS)
        deadline = time.monotonic() + duration_s
        budget = [max_requests]
        async with httpx.AsyncClient(timeout=self.timeout_s,
                                     limits=httpx.Limits(max_connections=64, max_keepalive_connections=32)) as c:
            await run_workers([self._loop(c, region, tl, w, deadline, budget)
                               for region in self.regions for tl in self.load for w in range(2)])
        return self.stats

    async def _loop(self, client: httpx.AsyncClient, region: str, tl: TenantLoad, worker: int, deadline: float,
                    budget: list[int]) -> None:
        rng = random.Random(f"{self.seed}-{region}-{tl.tenant}-{worker}")
        interval = 2.0 / tl.per_second  # two workers share the rate
        st = self.stats[region]
        n = 0
        async for _ in paced(interval, deadline, budget, rng, self._stop.is_set):
            agents = self.agents(region)
            if not agents:
                await asyncio.sleep(interval)
                continue
            name, url = agents[n % len(agents)]
            n += 1
            await self._one(client, region, name, url, tl, rng, st)

    async def _one(self, client: httpx.AsyncClient, region: str, agent: str, url: str, tl: TenantLoad,
                   rng: random.Random, st: RegionStats) -> None:
        body = {"requestId": f"c-{uuid.UUID(int=rng.getrandbits(128)).hex[:24]}", "tenantId": tl.tenant,
                "principal": {"type": "user", "id": f"U-{rng.randrange(tl.users)}", "apiKeyId": "K1"},
                "routeGroup": rng.choice(tl.routes), "method": "GET", "costHint": 1}
        st.sent += 1
        sent = now_ms()
        try:
            r = await client.post(url + "/v1/admit", json=body)
        except httpx.HTTPError:
            st.errors += 1  # no answer: the gateway did not admit (whatever the agent did)
            st.errors_by_tenant[tl.tenant] += 1
            return
        received = now_ms()
        if r.status_code != 200:
            st.errors += 1
            st.errors_by_tenant[tl.tenant] += 1
            return
        answer = r.json()
        local = self.is_local(region, sent)
        d = decision_from_admit(body, answer, self.bundle, region=region, agent=agent, sent_ms=sent,
                                received_ms=received, local=local)
        self.history.write(d)
        st.per_agent[agent] += 1
        if d.allowed:
            st.allowed += 1
        else:
            st.denied += 1
        if d.fallback:
            st.fallback += 1
        if d.local:
            st.local += 1


class LeasePoller:
    """Record the leases agents hold (``GET /v1/leases``) as region ``grant`` records, once each."""

    def __init__(self, history: HistoryWriter, agents: Callable[[], Sequence[tuple[str, str, str]]]):
        self.history = history
        self.agents = agents  # [(name, region, url)]
        self.seen: set[tuple] = set()
        self.polls = 0
        self.errors = 0

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        for _name, region, url in self.agents():
            try:
                r = await client.get(url + "/v1/leases")
                view = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                self.errors += 1
                continue
            self.polls += 1
            if not isinstance(view, dict):
                continue
            now = now_ms()
            for bal in view.get("balances") or []:
                for lease in bal.get("leases") or []:
                    key = (lease["leaseId"], lease["granted"], lease["window"], lease["epoch"])
                    if key in self.seen:
                        continue
                    self.seen.add(key)
                    exp = int(lease.get("expiresInMs", 0))
                    self.history.write(Grant(lease_id=lease["leaseId"], pool=bal["pool"], region=region,
                                             granted=int(lease["granted"]), window_index=int(lease["window"]),
                                             expires_at_ms=now + exp, ttl_ms=max(0, exp), epoch=int(lease["epoch"]),
                                             source="region"))

    async def run(self, duration_s: float, interval_s: float = 0.5, stop: asyncio.Event | None = None) -> None:
        deadline = time.monotonic() + duration_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                await self.poll_once(client)
                await asyncio.sleep(interval_s)


#: the agent counters sampled during a run (``metric{labels}`` prefixes)
SAMPLED = ("leasehold_agent_degraded_decisions_total", "leasehold_agent_shed_total")


class CounterSampler:
    """Sample every agent's degradation and shedding counters every 2 s into ``counters`` records
    (only when they changed), so a fallback decision can be matched to the degradation the agent
    counted around that moment (a scrape costs the agent a few ms: not more often). Bounded in
    time like the load."""

    def __init__(self, history: HistoryWriter, agents: Callable[[], Sequence[tuple[str, str]]]):
        self.history = history
        self.agents = agents  # [(name, url)]
        self.last: dict[str, dict[str, float]] = {}

    async def sample_once(self, client: httpx.AsyncClient) -> None:
        for name, url in self.agents():
            try:
                r = await client.get(url + "/metrics")
            except httpx.HTTPError:
                continue
            values = {}
            for line in r.text.splitlines():
                if line.startswith(SAMPLED):
                    key, _, val = line.rpartition(" ")
                    try:
                        values[key] = float(val)
                    except ValueError:
                        continue
            if values and values != self.last.get(name):
                self.last[name] = values
                self.history.write(Counters(service=name, at_ms=now_ms(), values=values))

    async def run(self, duration_s: float, interval_s: float = 2.0, stop: asyncio.Event | None = None) -> None:
        deadline = time.monotonic() + duration_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                await self.sample_once(client)
                await asyncio.sleep(interval_s)
