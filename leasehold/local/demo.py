"""``make run``: start the local topology with an Envoy in front of each region (Envoy's rate
limit filter asking the region's agent over RLS gRPC, ``deploy/gateways/envoy-rls.yaml``; with
``--gateway rlqs`` the rate limit quota filter of ``deploy/gateways/envoy-rlqs.yaml``, Envoy deciding
locally from quota the agent assigns, shown per bucket in the live view) and a
demo upstream behind them, drive Northstar demo traffic *through Envoy* as plain HTTP requests,
and show a live view until Ctrl-C (or ``duration``), then stop everything.

What a client sees is counted from Envoy's answers (200, 429, 503); which rule denied and how
many decisions were local fallbacks come from each agent's ``/metrics``. Clients prove who they
are with bearer tokens of a development identity provider (:class:`leasehold.local.devjwt.DevIssuer`,
its JWKS in ``.run/jwks.json``), which Envoy verifies; they connect from a few loopback
addresses each, as real clients would (every request spends its address's window first).

Traffic (bounded in rate, concurrency and time): 40 Atlas users reading (together far above
Atlas's worldwide 1,000 per minute, so both regions see tenant-atlas-global 429s once the window's
pool is spent; one of them, U-17, far above P-READ so it collects 429s of its own), Birch users reading, Atlas exports (cost 10,
concurrency 3, released after a few seconds) and anonymous logins from a few IPs (one of
them abusive, so P-ANON bites). Besides, the operators' internal health prober asks each agent
directly, about twice a second, for tenant ``northstar-ops`` on route group ``probe``: a capped,
owned, audited bypass (docs/invariants.md I14) - it reaches its cap of 60 per minute, and every use is
in ``.run/audit-<region>-<n>.jsonl``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import signal
import time
import uuid
from dataclasses import dataclass, field

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from .devjwt import DevIssuer
from .gateways import Envoy, render, tracing_values, upstream
from .procs import LOOPBACK, Proc, free_port
from .topology import LocalTopology, TopologySpec


@dataclass
class RegionPanel:
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


CLIENT_ADDRESSES = tuple(f"127.0.2.{i}" for i in range(1, 9))  # the authenticated clients' sources


class Driver:
    def __init__(self, topo: LocalTopology, envoys: dict[str, str], rate: float, rng: random.Random,
                 issuer: DevIssuer | None = None):
        self.topo = topo
        self.envoys = envoys  # region -> Envoy URL
        self.rate = rate
        self.rng = rng
        self.issuer = issuer or DevIssuer()
        self._tokens: dict[tuple[str, str, str | None], dict[str, str]] = {}
        self.stats = {r: RegionPanel() for r in envoys}
        self.sem = asyncio.Semaphore(64)
        self.client = httpx.AsyncClient(timeout=2.0, limits=httpx.Limits(max_connections=64))
        self.agents = httpx.AsyncClient(timeout=2.0, headers=topo.gateway_headers())  # /v1/release
        self.anon: dict[str, httpx.AsyncClient] = {}  # one client per source address
        self.tasks: set[asyncio.Task] = set()

    def _anon_client(self, ip: str) -> httpx.AsyncClient:
        c = self.anon.get(ip)
        if c is None:
            c = self.anon[ip] = httpx.AsyncClient(timeout=2.0, transport=httpx.AsyncHTTPTransport(local_address=ip))
        return c

    def _bearer(self, user: str, tenant: str, key: str | None = None) -> dict[str, str]:
        """The client's Authorization header (a token per identity, signed once)."""
        k = (user, tenant, key)
        h = self._tokens.get(k)
        if h is None:
            h = self._tokens[k] = self.issuer.bearer(user, tenant, key)
        return h

    def _request(self) -> tuple[str, str, str, dict[str, str], str | None, tuple[str, str] | None]:
        """(region, method, path, headers, source address, (tenant, user) or None) of one demo
        request."""
        region = self.rng.choice(list(self.envoys))
        roll = self.rng.random()
        source = self.rng.choice(CLIENT_ADDRESSES)
        if roll < 0.25:
            return region, "GET", "/catalog", self._bearer("U-17", "atlas", "K1"), source, None
        if roll < 0.55:
            return region, "GET", "/catalog", self._bearer(f"U-{self.rng.randint(1, 40)}", "atlas"), source, None
        if roll < 0.75:
            return region, "GET", "/catalog", self._bearer(f"B-{self.rng.randint(1, 5)}", "birch"), source, None
        if roll < 0.80:
            user = f"U-{self.rng.randint(1, 8)}"
            return region, "POST", "/reports/export", self._bearer(user, "atlas"), source, ("atlas", user)
        ip = "127.0.0.9" if self.rng.random() < 0.6 else f"127.0.1.{self.rng.randint(1, 20)}"
        return region, "POST", "/login", {}, ip, None

    async def one(self) -> None:
        region, method, path, headers, ip, exporter = self._request()
        st = self.stats[region]
        client = self._anon_client(ip)
        async with self.sem:
            try:
                r = await client.request(method, self.envoys[region] + path, headers=headers)
            except httpx.HTTPError:
                st.errors += 1
                return
        if r.status_code == 200:
            st.allowed += 1
            if exporter is not None:
                st.exports_in_flight += 1
                decision_id = r.json().get("headers", {}).get("x-request-id", "")  # what the backend was sent
                self._spawn(self.release_later(region, exporter, decision_id, st))
        elif r.status_code == 429:
            st.denied += 1
        elif r.status_code == 503:
            st.unavailable += 1
        else:
            st.errors += 1

    async def release_later(self, region: str, exporter: tuple[str, str], decision_id: str,
                            st: RegionPanel) -> None:
        """The backend ends the export: POST /v1/release with the decision id Envoy minted and sent
        it (x-request-id)."""
        await asyncio.sleep(self.rng.uniform(1.0, 4.0))
        tenant, user = exporter
        payload = {"requestId": decision_id, "tenantId": tenant, "principal": {"type": "user", "id": user},
                   "routeGroup": "export"}
        try:
            await self.agents.post(self.topo.agent_urls[region][0] + "/v1/release", json=payload)
        except httpx.HTTPError:
            pass
        st.exports_in_flight -= 1

    async def scrape(self) -> None:
        """Fallback decisions and denials by rule, from each region's agents."""
        for region, urls in self.topo.agent_urls.items():
            st = self.stats[region]
            fallback, by_rule = 0, collections.Counter()
            for url in urls:
                try:
                    text = (await self.agents.get(url + "/metrics")).text
                except httpx.HTTPError:
                    continue
                for line in text.splitlines():
                    if not line.startswith("leasehold_agent_decisions_total{"):
                        continue
                    head, _, value = line.rpartition(" ")
                    n = int(float(value))
                    if 'outcome="fallback_' in head:
                        fallback += n
                    if 'outcome="denied"' in head or 'outcome="fallback_denied"' in head:
                        rule = head.split('rule="', 1)[1].split('"', 1)[0]
                        by_rule[rule] += n
            st.fallback, st.deny_by_rule = fallback, by_rule

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def probe(self) -> None:
        """One health probe per region from the operators' prober, straight to an agent."""
        for region, urls in self.topo.agent_urls.items():
            body = {"requestId": f"probe-{uuid.uuid4().hex[:20]}", "tenantId": "northstar-ops",
                    "principal": {"type": "service", "id": "prober"}, "routeGroup": "probe"}
            try:
                await self.agents.post(self.rng.choice(urls) + "/v1/admit", json=body)
            except httpx.HTTPError:
                self.stats[region].errors += 1

    async def run(self, until: float, stop: asyncio.Event) -> None:
        tick = 0.05
        carry = 0.0
        ticks = 0
        while time.monotonic() < until and not stop.is_set():
            ticks += 1
            if ticks % 10 == 0 and len(self.tasks) < 512:
                self._spawn(self.probe())
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
        for c in (self.client, self.agents, *self.anon.values()):
            await c.aclose()


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


async def _rlqs_view(client: httpx.AsyncClient, topo: LocalTopology) -> list[tuple[str, dict]]:
    """(region, bucket) of every agent's quota assignments (``GET /v1/rlqs``, an operator's view)."""
    out: list[tuple[str, dict]] = []
    for region, urls in topo.agent_urls.items():
        for url in urls:
            try:
                view = (await client.get(url + "/v1/rlqs", headers=topo.operator_headers())).json()
            except (httpx.HTTPError, ValueError):
                continue
            out.extend((region, b) for b in view.get("buckets", []))
    return out


def _rlqs_table(buckets: list[tuple[str, dict]], top: int = 10) -> Table:
    t = Table(title="RLQS — quota assignments per bucket (Envoy decides locally; GET /v1/rlqs)", expand=True)
    t.add_column("region", no_wrap=True)
    t.add_column("bucket (tenant/user/key/route)", min_width=24, ratio=3)
    for col in ("Envoys", "held", "left", "demand/s", "funded", "stranded", "refused"):
        t.add_column(col, no_wrap=True)
    rows = []
    for region, b in buckets:
        envoys = b.get("envoys", [])
        rows.append((sum(e.get("demandPerS", 0) for e in envoys), region, b, envoys))
    for demand, region, b, envoys in sorted(rows, key=lambda x: -x[0])[:top]:
        key = b.get("bucket", {})
        name = "/".join(str(key[k]) for k in ("tenant", "user", "api_key", "route_group") if k in key) or str(key)
        t.add_row(region, name, str(len(envoys)), str(sum(e["tokens"] for e in envoys if e.get("live"))),
                  f"{sum(e.get('left', 0) for e in envoys):.0f}", f"{demand:.1f}",
                  str(sum(e.get("funded", 0) for e in envoys)), str(sum(e.get("stranded", 0) for e in envoys)),
                  b.get("refused") or "-")
    return t


def _render(driver: Driver, prev: dict, dt: float, alloc_line: str, pools: list[dict], elapsed: float,
            extra: tuple = ()) -> Group:
    # two tables, so that an 80-column terminal shows every column whole: the rules that denied
    # most had the width the counters left, none at 80 columns
    t = Table(title=f"Leasehold demo — {elapsed:5.0f}s — clients through Envoy, per region, per second", expand=True)
    for col in ("region", "admitted/s", "denied/s", "503/s", "fallback/s", "exports in flight", "errors"):
        t.add_column(col, no_wrap=col != "exports in flight")
    top = Table(title="Rules that denied most, per region (rule: count)", expand=True)
    top.add_column("region", no_wrap=True)
    top.add_column("top denials", ratio=1)
    for region, st in driver.stats.items():
        a, d, u, f = st.snapshot()
        pa, pd, pu, pf = prev.get(region, (0, 0, 0, 0))
        t.add_row(region, f"{(a - pa) / dt:.0f}", f"{(d - pd) / dt:.0f}", f"{(u - pu) / dt:.0f}",
                  f"{(f - pf) / dt:.0f}", str(st.exports_in_flight), str(st.errors))
        top.add_row(region, ", ".join(f"{k}: {v}" for k, v in st.deny_by_rule.most_common(3)) or "-")
    pt = Table(title=f"Global pools — {alloc_line}", expand=True)
    for col in ("pool", "window", "G", "remaining", "granted by region", "leases"):
        pt.add_column(col)
    for v in pools:
        regions = ", ".join(f"{r['region']} {r['granted']}" for r in v.get("regions", []))
        w = v.get("window", {})
        pt.add_row(str(v.get("pool")), str(w.get("index")), str(v.get("limit")), str(v.get("remaining")),
                   regions or "-", str(v.get("leasesOutstanding")))
    return Group(t, top, pt, *extra)


async def _main(spec: TopologySpec, duration_s: float, rate: float, summary: bool = False, gateway: str = "rls") -> int:
    console = Console(stderr=summary)  # -o json: the live view on stderr, the summary alone on stdout
    console.print("[bold]Starting the local topology[/bold] (etcd, allocators, Redis and an agent per region, "
                  "an Envoy in front of each region, a demo upstream)…")
    spec.rls = True
    topo = await asyncio.to_thread(LocalTopology(spec).start)
    try:
        edge = await asyncio.to_thread(start_edge, topo, gateway)
    except BaseException:
        await asyncio.to_thread(topo.stop)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    driver = Driver(topo, {r: e.url for r, e in edge.envoys.items()}, rate, random.Random(42), edge.issuer)
    until = time.monotonic() + duration_s
    started = time.monotonic()
    traffic = asyncio.create_task(driver.run(until, stop))
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            prev: dict = {}
            last = time.monotonic()
            interactive = console.file.isatty()
            with Live(console=console, refresh_per_second=4, transient=False) if interactive else _NoLive() as live:
                while not stop.is_set() and time.monotonic() < until:
                    await asyncio.wait({asyncio.ensure_future(stop.wait())}, timeout=1.0)
                    now = time.monotonic()
                    alloc_line, pools = await _allocator_view(client, topo.allocator_urls)
                    await driver.scrape()
                    extra = (_rlqs_table(await _rlqs_view(client, topo)),) if gateway == "rlqs" else ()
                    view = _render(driver, prev, max(now - last, 1e-3), alloc_line, pools, now - started, extra)
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
        await asyncio.to_thread(edge.stop)
        await asyncio.to_thread(topo.stop)
        console.print("Stopped. Nothing is left running.")
        if summary:
            print(json.dumps({"durationS": round(time.monotonic() - started, 1), "regions": {
                r: {"allowed": st.allowed, "denied": st.denied, "unavailable": st.unavailable,
                    "fallback": st.fallback, "errors": st.errors, "deniedByRule": dict(st.deny_by_rule)}
                for r, st in driver.stats.items()}}, indent=2))
    return 0


@dataclass
class Edge:
    """The gateways of the demo: the upstream and an Envoy per region (RLS to that region's agent)."""

    upstream: Proc
    envoys: dict[str, Envoy]
    issuer: DevIssuer

    def stop(self) -> None:
        for e in self.envoys.values():
            e.stop()
        self.upstream.stop()


GATEWAY_CONFIGS = {"rls": "envoy-rls.yaml", "rlqs": "envoy-rlqs.yaml"}


def start_edge(topo: LocalTopology, gateway: str = "rls") -> Edge:
    """``gateway``: which shipped Envoy configuration (GATEWAY_CONFIGS) the Envoys run."""
    run = topo.spec.run_dir
    template = GATEWAY_CONFIGS[gateway]
    issuer = DevIssuer()  # the demo's identity provider: Envoy verifies its tokens (jwt_authn)
    jwks = issuer.write_jwks(run / "jwks.json")
    up, up_port = upstream(run / "upstream")
    envoys: dict[str, Envoy] = {}
    try:
        for region, ports in topo.rls_ports.items():
            port, admin = free_port(), free_port()
            cfg = render(template, ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                         ENVOY_ACCESS_LOG=run / f"envoy-{region}" / "access.log",
                         AGENT_HOST=LOOPBACK, AGENT_RLS_PORT=ports[0], UPSTREAM_HOST=LOOPBACK, UPSTREAM_PORT=up_port,
                         GATEWAY_TOKEN=topo.secrets.gateway if topo.secrets else "auth-disabled",
                         **issuer.values(jwks), **tracing_values())
            envoys[region] = Envoy(f"envoy-{region}", cfg, run / f"envoy-{region}", port, admin).start()
    except BaseException:
        Edge(up, envoys, issuer).stop()
        raise
    return Edge(up, envoys, issuer)


class _NoLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, _view) -> None:
        pass


def run_demo(spec: TopologySpec, duration_s: float = 600.0, rate: float = 200.0, summary: bool = False,
             gateway: str = "rls") -> int:
    """``summary``: print the run's totals as one JSON document on stdout at the end
    (``leasehold demo -o json``; the live view then goes to stderr). ``gateway``: ``rls`` or
    ``rlqs`` (the Envoys' shipped configuration, :data:`GATEWAY_CONFIGS`)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_main(spec, duration_s, rate, summary, gateway))
