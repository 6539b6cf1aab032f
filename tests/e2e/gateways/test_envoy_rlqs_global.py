"""RLQS across regions: two regions (eu, us), each a Redis and an agent, one allocator on etcd;
two Envoys in front of eu's agent and one in front of us's, all three on the shipped
``deploy/gateways/envoy-rlqs.yaml`` (Envoy decides locally from quota assignments). Birch's
worldwide pool (``birch-minute``, G = 300 per 60 s window) is asked far more by 30 users whose
requests rotate over the three Envoys: per pool window, the clients' admissions never exceed G
plus the bound's RLQS term (0 here: 60 s windows end every assignment in them, and the shipped
fallbacks are deny-all), and every region admits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kernel.bound import RlqsShape, envoy_fallback_tokens, rlqs_term
from leasehold.local.gateways import Envoy, render, upstream
from leasehold.local.procs import LOOPBACK, Proc, free_port
from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.windows import clear_of_window_edges_sync

from .conftest import ISSUER, identity
from .conftest import agent_metric as metric
from .test_envoy_global import AGENT_ARGS, Sent

pytestmark = pytest.mark.e2e

G = 300
WINDOW_MS = 60_000
USERS = 30
DRIVE_S = 20.0


@dataclass
class Fleet:
    topo: LocalTopology
    envoys: dict[str, tuple[str, Envoy]]  # name -> (region, Envoy)
    upstream: Proc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    run = Path(tmp_path_factory.mktemp("rlqs-global"))
    spec = TopologySpec(run_dir=run, regions=("eu", "us"), agents_per_region=1, allocators=1, auth=True, rls=True,
                        agent_args=AGENT_ARGS, allocator_args=("--log-level", "warning"))
    topo = LocalTopology(spec).start(timeout=90)
    envoys: dict[str, tuple[str, Envoy]] = {}
    up = None
    try:
        up, up_port = upstream(run / "upstream")
        assert topo.secrets is not None
        jwks = ISSUER.write_jwks(run / "jwks.json")
        for name, region in (("eu-a", "eu"), ("eu-b", "eu"), ("us", "us")):
            port, admin = free_port(), free_port()
            cfg = render("envoy-rlqs.yaml", ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                         ENVOY_ACCESS_LOG=run / f"envoy-{name}" / "access.log", AGENT_HOST=LOOPBACK,
                         AGENT_RLS_PORT=topo.rls_ports[region][0], UPSTREAM_HOST=LOOPBACK, UPSTREAM_PORT=up_port,
                         GATEWAY_TOKEN=topo.secrets.gateway, **ISSUER.values(jwks))
            envoys[name] = (region, Envoy(f"envoy-{name}", cfg, run / f"envoy-{name}", port, admin).start())
        yield Fleet(topo, envoys, up)
    finally:
        for _, e in envoys.values():
            e.stop()
        if up is not None:
            up.stop()
        topo.stop()


async def drive(fleet: Fleet) -> list[Sent]:
    """Every user asks every 0.25 s for DRIVE_S seconds, each request through the next Envoy."""
    out: list[Sent] = []
    names = list(fleet.envoys)
    end = time.monotonic() + DRIVE_S

    async def user(client: httpx.AsyncClient, u: int) -> None:
        headers = identity(f"B-{u}", tenant="birch", key=None)
        for i in range(int(DRIVE_S / 0.25) + 1):
            if time.monotonic() >= end:
                return
            region, envoy = fleet.envoys[names[(u + i) % len(names)]]
            t0 = time.time() * 1000
            r = await client.get(envoy.url + "/catalog", headers=headers)
            out.append(Sent(region, t0, time.time() * 1000, r.status_code, r.headers.get("retry-after")))
            await asyncio.sleep(0.25)

    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=32)) as client:
        await asyncio.gather(*(user(client, u) for u in range(USERS)))
    return out


def test_a_tenant_pool_through_rlqs_envoys_never_exceeds_g_plus_the_rlqs_term(fleet: Fleet):
    shipped = RlqsShape(envoys={"eu": 2, "us": 1}, buckets=USERS, max_assignment=100,
                        fallback=envoy_fallback_tokens("DENY_ALL", "DENY_ALL"))
    term = rlqs_term(shipped, WINDOW_MS)
    assert term.tokens == 0, term  # a 60 s window clamps every assignment; deny-all fallbacks
    rls_before = {r: metric(urls[0], "leasehold_agent_rls_requests_total") for r, urls in fleet.topo.agent_urls.items()}
    clear_of_window_edges_sync(WINDOW_MS, before_ms=int((DRIVE_S + 15.0) * 1000))
    sent = asyncio.run(drive(fleet))
    assert {s.status for s in sent} <= {200, 429}, sorted({s.status for s in sent})
    # per pool window (allocator windows are Unix-time-aligned): a request whose send and answer fall
    # in different windows is counted against both (conservative)
    admitted: dict[int, int] = {}
    for s in sent:
        if s.status == 200:
            for w in {int(s.sent_ms) // WINDOW_MS, int(s.done_ms) // WINDOW_MS}:
                admitted[w] = admitted.get(w, 0) + 1
    assert admitted and max(admitted.values()) <= G + term.tokens, admitted
    assert len(sent) - sum(1 for s in sent if s.status == 200) >= len(sent) - G - term.tokens  # far above G
    per_region = {r: sum(1 for s in sent if s.status == 200 and s.region == r) for r in ("eu", "us")}
    assert all(n > 0 for n in per_region.values()), per_region
    for region, urls in fleet.topo.agent_urls.items():
        # the allocator was up: no regional fallback; Envoy decided every request itself (no RLS call)
        assert metric(urls[0], "leasehold_agent_degraded_decisions_total", reason="ALLOCATOR_UNREACHABLE") == 0
        assert metric(urls[0], "leasehold_agent_rls_requests_total") == rls_before[region]
        assert metric(urls[0], "leasehold_agent_rlqs_assigned_tokens_total") >= per_region[region]
    view = httpx.get(fleet.topo.allocator_urls[0] + "/v1/pools/birch-minute", timeout=5).json()
    assert sum(r["granted"] for r in view["regions"]) <= G
