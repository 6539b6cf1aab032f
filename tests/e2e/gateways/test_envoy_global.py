"""Global pools through real gateways: two regions (eu, us), each a Redis and an agent serving
RLS, one allocator on etcd, and an Envoy per region (``deploy/gateways/envoy-rls.yaml``) in front
of the demo upstream. Birch's worldwide pool (``birch-minute``, G = 300 per 60 s window) is
asked for 400 requests split across both Envoys: per window, the admitted requests never exceed
G while the allocator is up (no fallback allowance is spent), and both regions admit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from leasehold.local.gateways import Envoy, render, tracing_values, upstream
from leasehold.local.procs import LOOPBACK, Proc, free_port
from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.windows import clear_of_window_edges_sync

from .conftest import ISSUER, identity

pytestmark = pytest.mark.e2e

G = 300
WINDOW_MS = 60_000
AGENT_ARGS = ("--decision-budget-ms", "250", "--lease-tick-ms", "50", "--policy-poll-ms", "0", "--log-level", "warning")


@dataclass
class Fleet:
    topo: LocalTopology
    envoys: dict[str, Envoy]
    upstream: Proc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    run = Path(tmp_path_factory.mktemp("global"))
    spec = TopologySpec(run_dir=run, regions=("eu", "us"), agents_per_region=1, allocators=1, auth=True, rls=True,
                        agent_args=AGENT_ARGS, allocator_args=("--log-level", "warning"))
    topo = LocalTopology(spec).start(timeout=90)
    envoys: dict[str, Envoy] = {}
    up = None
    try:
        up, up_port = upstream(run / "upstream")
        assert topo.secrets is not None
        for region in spec.regions:
            port, admin = free_port(), free_port()
            cfg = render("envoy-rls.yaml", ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                         AGENT_HOST=LOOPBACK, AGENT_RLS_PORT=topo.rls_ports[region][0], UPSTREAM_HOST=LOOPBACK,
                         UPSTREAM_PORT=up_port, GATEWAY_TOKEN=topo.secrets.gateway,
                         **ISSUER.values(ISSUER.write_jwks(run / "jwks.json")), **tracing_values())
            envoys[region] = Envoy(f"envoy-{region}", cfg, run / f"envoy-{region}", port, admin).start()
        yield Fleet(topo, envoys, up)
    finally:
        for e in envoys.values():
            e.stop()
        if up is not None:
            up.stop()
        topo.stop()


@dataclass
class Sent:
    region: str
    sent_ms: float
    done_ms: float
    status: int
    retry_after: str | None


async def drive(fleet: Fleet, users: int, per_user: int) -> list[Sent]:
    out: list[Sent] = []
    sem = asyncio.Semaphore(16)
    regions = list(fleet.envoys)

    async def one(client: httpx.AsyncClient, region: str, user: str) -> None:
        async with sem:
            t0 = time.time() * 1000
            r = await client.get(fleet.envoys[region].url + "/catalog", headers=identity(user, tenant="birch", key=None))
            out.append(Sent(region, t0, time.time() * 1000, r.status_code, r.headers.get("retry-after")))

    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(*(one(client, regions[u % 2], f"B-{u}") for u in range(users) for _ in range(per_user)))
    return out


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def test_tenant_pool_g_is_honoured_across_two_envoys(fleet: Fleet):
    clear_of_window_edges_sync(WINDOW_MS, before_ms=15_000)
    sent = asyncio.run(drive(fleet, users=40, per_user=10))  # 400 asked, G = 300
    assert len(sent) == 400
    assert {s.status for s in sent} <= {200, 429}, sorted({s.status for s in sent})
    # per pool window (allocator windows are Unix-time-aligned): a request whose send and answer fall
    # in different windows is counted against both (conservative)
    admitted: dict[int, int] = {}
    for s in sent:
        if s.status == 200:
            for w in {int(s.sent_ms) // WINDOW_MS, int(s.done_ms) // WINDOW_MS}:
                admitted[w] = admitted.get(w, 0) + 1
    assert admitted and max(admitted.values()) <= G, admitted
    denied = [s for s in sent if s.status == 429]
    assert len(denied) >= 400 - G and all(s.retry_after is not None for s in denied)
    per_region = {r: sum(1 for s in sent if s.status == 200 and s.region == r) for r in fleet.envoys}
    assert all(n > 0 for n in per_region.values()), per_region
    for urls in fleet.topo.agent_urls.values():
        # the allocator was up: the regional fallback allowance is never used (docs/invariants.md I8)
        assert metric(urls[0], "leasehold_agent_degraded_decisions_total", reason="ALLOCATOR_UNREACHABLE") == 0
        assert metric(urls[0], "leasehold_agent_rls_requests_total") >= 1
    for e in fleet.envoys.values():  # every 200 was the agent's answer: Envoy never failed open
        stats = e.stats("cluster.upstream.ratelimit.")
        assert stats.get("cluster.upstream.ratelimit.failure_mode_allowed", 0) == 0, (e.name, stats)
        assert stats.get("cluster.upstream.ratelimit.error", 0) == 0, (e.name, stats)
    view = httpx.get(fleet.topo.allocator_urls[0] + "/v1/pools/birch-minute", timeout=5).json()
    assert sum(r["granted"] for r in view["regions"]) <= G
