"""``make run``: start the local topology, drive Northstar demo traffic through every
region's agent, and show a live view until Ctrl-C (or ``duration``), then stop everything.

Traffic (bounded in rate, concurrency and time): 40 Atlas users reading (together far above
Atlas's worldwide 1,000 per minute, so both regions see tenant-atlas-global 429s once the window's
pool is spent; one of them, U-17, far above P-READ so it collects 429s of its own), Birch users reading, Atlas exports (cost 10,
concurrency 3, released after a few seconds) and anonymous logins from a few IPs (one of
them abusive, so P-ANON bites).
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .topology import Topology, TopologySpec


@dataclass
class RegionStats:
    allowed: int = 0
    denied: int = 0
    unavailable: int = 0
    fallback: int = 0
    errors: int = 0
    deny_by_rule: collections.Counter = field(default_factory=collections.Counter)
    exports_in_flight: int = 0
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))

    def snapshot(self) -> tuple[int, int, int, int]:
        return (self.allowed, self.denied, self.unavailable, self.fallback)


class Driver:
    def __init__(self, topo: Topology, rate: float, rng: random.Random):
        self.topo = topo
        self.rate = rate
        self.rng = rng
        self.stats = {r: RegionStats() for r in topo.agent_urls}
        self.sem = asyncio.Semaphore(64)
        self.client = httpx.AsyncClient(timeout=2.0, limits=httpx.Limits(max_connections=64),
                                        headers=topo.gateway_headers())
        self.tasks: set[asyncio.Task] = set()

    def _request(self) -> tuple[str, dict, bool]:
        region = self.rng.choice(list(self.topo.agent_urls))
        roll = self.rng.random()
        rid = f"demo-{uuid.uuid4().hex[:20]}"
        if roll < 0.01:  # the operators' health probe: a capped, audited bypass (seed ch. 16, I14)
            body = {"tenantId": "northstar-ops", "principal": {"type": "service", "id": "prober"},
                    "routeGroup": "probe"}
        elif roll < 0.25:
            user = "U-17"
            body = {"tenantId": "atlas", "principal": {"type": "user", "id": user, "apiKeyId": "K1"}, "routeGroup": "read"}
        elif roll < 0.55:
            body = {"tenantId": "atlas", "principal": {"type": "user", "id": f"U-{self.rng.randint(1, 40)}"},
                    "routeGroup": "read"}
        elif roll < 0.75:
            body = {"tenantId": "birch", "principal": {"type": "user", "id": f"B-{self.rng.randint(1, 5)}"},
                    "routeGroup": "read"}
        elif roll < 0.80:
            body = {"tenantId": "atlas", "principal": {"type": "user", "id": f"U-{self.rng.randint(1, 8)}"},
                    "routeGroup": "export", "costHint": 1}
        else:
            ip = "203.0.113.9" if self.rng.random() < 0.6 else f"198.51.100.{self.rng.randint(1, 20)}"
            body = {"principal": {"type": "anonymous", "id": ip}, "routeGroup": "login"}
        body.update({"requestId": rid, "method": "GET"})
        return region, body, body["routeGroup"] == "export"

    async def one(self) -> None:
        region, body, is_export = self._request()
        url = self.rng.choice(self.topo.agent_urls[region])
        st = self.stats[region]
        async with self.sem:
            try:
                r = await self.client.post(url + "/v1/admit", json=body)
                d = r.json()
            except (httpx.HTTPError, ValueError):
                st.errors += 1
                return
        if r.status_code != 200:
            st.errors += 1
            return
        if d.get("fallback"):
            st.fallback += 1
        status = d.get("httpStatus", 200)
        if status == 200:
            st.allowed += 1
            if is_export:
                st.exports_in_flight += 1
                self._spawn(self.release_later(url, body, st))
        elif status == 429:
            st.denied += 1
            st.deny_by_rule[d.get("policyId") or "?"] += 1
        else:
            st.unavailable += 1

    async def release_later(self, url: str, body: dict, st: RegionStats) -> None:
        await asyncio.sleep(self.rng.uniform(1.0, 4.0))
        payload = {k: body[k] for k in ("requestId", "tenantId", "principal", "routeGroup")}
        try:
            await self.client.post(url + "/v1/release", json=payload)
        except httpx.HTTPError:
            pass
        st.exports_in_flight -= 1

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def run(self, until: float, stop: asyncio.Event) -> None:
        tick = 0.05
        carry = 0.0
        while time.monotonic() < until and not stop.is_set():
            carry += self.rate * tick
            n, carry = int(carry), carry - int(carry)
            for _ in range(n):
                if len(self.tasks) < 512:
                    self._spawn(self.one())
            await asyncio.sleep(tick)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()


async def _allocator_view(client: httpx.AsyncClient, urls: list[str]) -> tuple[str, list[dict]]:
    for url in urls:
        try:
            leader = (await client.get(url + "/v1/leader")).json()
            pools = (await client.get(url + "/v1/pools")).json()
            views = []
            for p in pools if isinstance(pools, list) else []:
                r = await client.get(f"{url}/v1/pools/{p['id']}")
                if r.status_code == 200:
                    views.append(r.json())
            return f"leader {leader.get('nodeId')} epoch {leader.get('epoch')}", views
        except (httpx.HTTPError, ValueError, KeyError):
            continue
    return "allocator unreachable", []


def _render(driver: Driver, prev: dict, dt: float, alloc_line: str, pools: list[dict], elapsed: float) -> Group:
    t = Table(title=f"Leasehold demo — {elapsed:5.0f}s — per region, per second", expand=True)
    for col in ("region", "admitted/s", "denied/s", "503/s", "fallback/s", "exports in flight", "errors"):
        t.add_column(col, no_wrap=True)
    t.add_column("top denials (rule: count)", ratio=3)
    for region, st in driver.stats.items():
        a, d, u, f = st.snapshot()
        pa, pd, pu, pf = prev.get(region, (0, 0, 0, 0))
        top = ", ".join(f"{k} {v}" for k, v in st.deny_by_rule.most_common(3))
        t.add_row(region, f"{(a - pa) / dt:.0f}", f"{(d - pd) / dt:.0f}", f"{(u - pu) / dt:.0f}",
                  f"{(f - pf) / dt:.0f}", str(st.exports_in_flight), str(st.errors), top)
    pt = Table(title=f"Global pools — {alloc_line}", expand=True)
    for col in ("pool", "window", "G", "remaining", "granted by region", "leases"):
        pt.add_column(col)
    for v in pools:
        regions = ", ".join(f"{r['region']} {r['granted']}" for r in v.get("regions", []))
        w = v.get("window", {})
        pt.add_row(str(v.get("pool")), str(w.get("index")), str(v.get("limit")), str(v.get("remaining")),
                   regions or "-", str(v.get("leasesOutstanding")))
    return Group(t, pt)


async def _main(spec: TopologySpec, duration_s: float, rate: float) -> int:
    console = Console()
    console.print("[bold]Starting the local topology[/bold] (etcd, allocators, Redis and an agent per region)…")
    topo = await asyncio.to_thread(Topology(spec).start)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    driver = Driver(topo, rate, random.Random(42))
    until = time.monotonic() + duration_s
    started = time.monotonic()
    traffic = asyncio.create_task(driver.run(until, stop))
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            prev: dict = {}
            last = time.monotonic()
            interactive = sys.stdout.isatty()
            with Live(console=console, refresh_per_second=4, transient=False) if interactive else _NoLive() as live:
                while not stop.is_set() and time.monotonic() < until:
                    await asyncio.wait({asyncio.ensure_future(stop.wait())}, timeout=1.0)
                    now = time.monotonic()
                    alloc_line, pools = await _allocator_view(client, topo.allocator_urls)
                    view = _render(driver, prev, max(now - last, 1e-3), alloc_line, pools, now - started)
                    prev = {r: s.snapshot() for r, s in driver.stats.items()}
                    last = now
                    if interactive:
                        live.update(view)
                    else:
                        console.print(view)
    finally:
        stop.set()
        await traffic
        await driver.close()
        console.print("Stopping every process…")
        await asyncio.to_thread(topo.stop)
        console.print("Stopped. Nothing is left running.")
    return 0


class _NoLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, _view) -> None:
        pass


def run_demo(spec: TopologySpec, duration_s: float = 600.0, rate: float = 200.0) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_main(spec, duration_s, rate))
