"""One trace from the edge to the allocator's commit, through the shipped Envoy configurations
(``deploy/gateways/envoy-rls.yaml``, ``envoy-ext-authz.yaml``) as copied: only their placeholders
are filled, the trace collector among them (an OTLP/gRPC receiver in this test, which the agent and
the allocator export to as well).

* A client request through Envoy is one trace: Envoy's ingress span, its call to the agent (the
  RLS call's gRPC metadata, the ext_authz request's headers carry its ``traceparent``), the agent's
  decision as that call's child, the lease request the decision started, the allocator's request
  span as the agent's child and its commit transaction.
* The edge starts every trace and makes the one sampling decision: a client's ``traceparent``,
  ``tracestate``, ``x-client-trace-id`` or ``x-envoy-force-trace`` neither joins its trace nor
  forces one to be sampled.
* Without a collector (the sampling share 0, what :func:`leasehold.local.gateways.tracing_values` fills
  by default): nothing is exported, the collector's address is never dialled, and the agent,
  following Envoy's unsampled flag, records nothing either.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from leasehold.local.gateways import Envoy, render, tracing_values, upstream
from leasehold.local.procs import LOOPBACK, Proc, free_port
from leasehold.local.topology import LocalTopology, TopologySpec
from tests.support.otlp import Receiver, attrs, receiving
from tests.support.waiting import wait_until

from .conftest import ISSUER, identity

pytestmark = pytest.mark.e2e

DOORS = {"rls": ("envoy-rls.yaml", "leasehold_rls"), "authz": ("envoy-ext-authz.yaml", "leasehold_authz")}
SERVICE_ENVOY, SERVICE_AGENT, SERVICE_ALLOCATOR = "envoy", "leasehold-agent", "leasehold-allocator"


@dataclass
class Edge:
    receiver: Receiver
    topo: LocalTopology
    envoys: dict[str, Envoy]  # "rls", "authz": 100 % traced to the receiver; "off": no collector
    upstream: Proc


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    run = Path(tmp_path_factory.mktemp("envoy-trace"))
    with receiving() as (rec, port):
        flags = ("--otlp-endpoint", f"http://{LOOPBACK}:{port}")
        topo = LocalTopology(TopologySpec(run_dir=run, regions=("eu",), allocators=1, auth=True, rls=True,
                                          agent_args=(*flags, "--decision-budget-ms", "250", "--log-level",
                                                      "warning"),
                                          allocator_args=(*flags, "--log-level", "warning"))).start(timeout=90)
        envoys: dict[str, Envoy] = {}
        up = None
        try:
            assert topo.secrets is not None
            up, up_port = upstream(run / "upstream")
            values = {"ENVOY_LISTEN_HOST": LOOPBACK, "AGENT_HOST": LOOPBACK,
                      "AGENT_RLS_PORT": topo.rls_ports["eu"][0],
                      "AGENT_HTTP_PORT": int(topo.agent_urls["eu"][0].rsplit(":", 1)[1]),
                      "UPSTREAM_HOST": LOOPBACK, "UPSTREAM_PORT": up_port, "GATEWAY_TOKEN": topo.secrets.gateway,
                      **ISSUER.values(ISSUER.write_jwks(run / "jwks.json"))}
            for name, template, tracing in (
                    ("rls", DOORS["rls"][0], tracing_values((LOOPBACK, port), 100)),
                    ("authz", DOORS["authz"][0], tracing_values((LOOPBACK, port), 100)),
                    ("off", DOORS["rls"][0], tracing_values())):
                p, admin = free_port(), free_port()
                cfg = render(template, ENVOY_PORT=p, ENVOY_ADMIN_PORT=admin, **values, **tracing)
                envoys[name] = Envoy(f"envoy-{name}", cfg, run / f"envoy-{name}", p, admin).start()
            yield Edge(rec, topo, envoys, up)
        finally:
            for e in envoys.values():
                e.stop()
            if up is not None:
                up.stop()
            topo.stop()


def trace_of(response: httpx.Response) -> tuple[bytes, str]:
    """(trace id, flags) of the ``traceparent`` Envoy sent the upstream (echoed in its answer)."""
    assert response.status_code == 200, response.text
    _version, trace_id, _span, flags = response.json()["headers"]["traceparent"].split("-")
    return bytes.fromhex(trace_id), flags


@pytest.mark.parametrize("door", list(DOORS))
def test_one_request_through_envoy_is_one_trace_down_to_the_allocator_commit(edge: Edge, door: str):
    rec, envoy = edge.receiver, edge.envoys[door]
    sent: list[bytes] = []

    def lease_traced() -> list:
        ours = set(sent)
        return [sp for sp in rec.find(SERVICE_ALLOCATOR, "leasehold.lease_request") if sp.trace_id in ours]

    # Client requests until one decision started a lease request (a tenant pool's regional balance
    # ran low: Atlas's 1,000 and Birch's 300 a minute are leased in small parts). Bounded: at most
    # 100 of Birch's 300 per door; an admitted request's trace id is the upstream's echo.
    found: list = []
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        for batch in range(10):
            for i in range(20):
                tenant, user = (("atlas", f"U-{door}-{batch}-{i}"), ("birch", f"B-{door}-{batch}-{i}"))[i % 2]
                r = c.get("/catalog", headers=identity(user, tenant=tenant, key=None))
                if r.status_code == 429:  # a top-up slower than the decision's budget (a loaded machine)
                    continue
                trace_id, flags = trace_of(r)
                assert flags == "01"  # sampled at the edge (100 %)
                sent.append(trace_id)
            found = wait_until(lease_traced, 3.0)
            if found:
                break
    assert found, f"no decision of {len(sent)} requests through Envoy started a lease request"
    trace_id = found[0].trace_id

    def spans(service: str, name: str | None = None) -> list:
        return rec.find(service, name, trace_id)

    # Envoy exports its spans every few seconds
    ingress = wait_until(lambda: spans(SERVICE_ENVOY, "ingress"), 20.0)
    assert len(ingress) == 1 and not ingress[0].parent_span_id, "Envoy's span is the trace's root"
    calls = wait_until(lambda: [sp for sp in spans(SERVICE_ENVOY) if attrs(sp).get("upstream_cluster") == DOORS[door][1]],
                       20.0)
    assert len(calls) == 1 and calls[0].parent_span_id == ingress[0].span_id, "Envoy's call to the agent"
    (decision,) = wait_until(lambda: spans(SERVICE_AGENT, "leasehold.decision"), 10.0)
    assert decision.parent_span_id == calls[0].span_id, "the agent's decision is the child of Envoy's call"
    a = attrs(decision)
    assert a["leasehold.door"] == door and a["leasehold.allowed"] is True and a["decision.source"] in ("script", "chunk")
    agent_leases = spans(SERVICE_AGENT, "leasehold.lease_request")
    agent_ids = {sp.span_id for sp in spans(SERVICE_AGENT)}
    assert agent_leases and all(sp.parent_span_id in agent_ids for sp in agent_leases), "started by the decision"
    assert {sp.parent_span_id for sp in found if sp.trace_id == trace_id} <= {sp.span_id for sp in agent_leases}
    commits = wait_until(lambda: [sp for sp in rec.find(SERVICE_ALLOCATOR, "leasehold.allocator_commit")
                                  if sp.trace_id == trace_id or any(lk.trace_id == trace_id for lk in sp.links)], 10.0)
    assert commits and attrs(commits[0])["leasehold.kind"] in ("grants", "reports")


def hostile_trace_headers(trace_hex: str) -> dict[str, str]:
    """Everything a client could send to join, start or force a trace."""
    return {"traceparent": f"00-{trace_hex}-00000000000000aa-01", "tracestate": "vendor=client",
            "x-client-trace-id": trace_hex, "x-envoy-force-trace": "true", "b3": f"{trace_hex}-00000000000000bb-1"}


@pytest.mark.parametrize("door", list(DOORS))
def test_a_client_can_neither_join_nor_force_a_trace(edge: Edge, door: str):
    rec, envoy = edge.receiver, edge.envoys[door]
    client_trace = secrets.token_hex(16)
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        r = c.get("/catalog", headers={**hostile_trace_headers(client_trace), **identity(f"T-{door}", key=None)})
    minted, flags = trace_of(r)
    assert minted != bytes.fromhex(client_trace) and flags == "01"
    assert r.json()["headers"].get("tracestate", "") == "", r.json()["headers"]
    # the request was traced in Envoy's own trace, down to the agent's decision
    assert wait_until(lambda: rec.find(SERVICE_AGENT, "leasehold.decision", minted), 10.0)
    assert wait_until(lambda: rec.find(SERVICE_ENVOY, "ingress", minted), 20.0)
    assert rec.in_trace(bytes.fromhex(client_trace)) == []


def test_without_a_collector_nothing_is_traced_nor_dialled(edge: Edge):
    """The shipped files with tracing off (sampling share 0, any collector address): a client's
    sampled traceparent forces nothing; Envoy tells the agent "not sampled" and the agent, tracing
    to the receiver, follows it."""
    rec, envoy = edge.receiver, edge.envoys["off"]
    client_trace = secrets.token_hex(16)
    minted = []
    flushes = envoy.stats("tracing.opentelemetry.")["tracing.opentelemetry.timer_flushed"]
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        for i in range(5):
            trace_id, flags = trace_of(c.get("/catalog", headers={**hostile_trace_headers(client_trace),
                                                                   **identity(f"O-{i}", key=None)}))
            assert flags == "00" and trace_id != bytes.fromhex(client_trace)
            minted.append(trace_id)
    done_ns = time.time_ns()
    # Absence, measured: the agent has exported a span that ended after these requests (its
    # background lease requests are traced), and Envoy's flush timer has fired twice since.
    assert wait_until(lambda: any(sp.end_time_unix_nano > done_ns for sp in rec.find(SERVICE_AGENT)), 30.0)
    assert wait_until(lambda: envoy.stats("tracing.opentelemetry.")["tracing.opentelemetry.timer_flushed"]
                      >= flushes + 2, 30.0)
    assert [rec.in_trace(t) for t in minted] == [[]] * 5
    assert rec.in_trace(bytes.fromhex(client_trace)) == []
    stats = envoy.stats()
    assert stats["http.api.tracing.random_sampling"] == 0 and stats["http.api.tracing.not_traceable"] >= 5
    assert stats["tracing.opentelemetry.spans_sent"] == 0
    assert stats["cluster.otlp_collector.upstream_cx_total"] == 0, "the collector's address was dialled"
