"""Tracing across real processes: agents and allocator started with ``--otlp-endpoint`` pointing at
an OTLP/gRPC receiver in this test; requests carry a gateway's W3C ``traceparent`` (HTTP header,
RLS metadata) and the spans come back in the same trace: the decision (door, source, outcome),
its script call (shard), the lease request it started, the allocator's request span (child of
the agent's) and its commit transaction."""

from __future__ import annotations

import os
import secrets
import signal
import time

import grpc
import httpx
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_http_ready
from leasehold.local.services import agent_command
from leasehold.local.topology import DEFAULT_POLICY, LocalTopology, TopologySpec
from tests.support.otlp import attrs, receiving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def receiver():
    with receiving() as (rec, port):
        yield rec, f"http://{LOOPBACK}:{port}"


@pytest.fixture(scope="module")
def topology(receiver, tmp_path_factory):
    _, endpoint = receiver
    flags = ("--otlp-endpoint", endpoint)
    topo = LocalTopology(TopologySpec(run_dir=tmp_path_factory.mktemp("trace-topo"), regions=("eu",), allocators=1,
                                      auth=True, rls=True, agent_args=flags, allocator_args=flags)).start()
    yield topo
    topo.stop()


def _covering(spans, parents):
    """``spans`` when they include every span id of ``parents``, else None."""
    return spans if parents <= {sp.span_id for sp in spans} else None


def test_a_trace_crosses_gateway_agent_and_allocator(receiver, topology):
    rec, _ = receiver
    agent = topology.agent_urls["eu"][0]
    trace_hex = secrets.token_hex(16)
    trace_id = bytes.fromhex(trace_hex)
    sent = 0
    with httpx.Client(timeout=5, headers=topology.gateway_headers()) as c:
        # decisions of one gateway trace (each its own parent span) until one of them started a
        # lease request that reached the allocator (a pool's balance ran low: bounded)
        for batch in range(12):
            for i in range(60):
                sent += 1
                tenant, route = (("atlas", "read"), ("zeta", "read"), ("birch", "read"))[i % 3]
                r = c.post(agent + "/v1/admit", headers={"traceparent": f"00-{trace_hex}-{sent:016x}-01"}, json={
                    "requestId": f"trace-{batch:03d}-{i:04d}", "tenantId": tenant,
                    "principal": {"type": "user", "id": f"T-{sent}"}, "routeGroup": route})
                assert r.status_code == 200, r.text
            if wait_until(lambda: rec.find("leasehold-allocator", "leasehold.lease_request", trace_id), 2.0):
                break
        # the forward-auth and RLS doors take the gateway's context too
        authz_trace = secrets.token_hex(16)
        r = c.get(agent + "/v1/authz/catalog", headers={
            "traceparent": f"00-{authz_trace}-00000000000000aa-01", "x-tenant-id": "birch", "x-user-id": "B-1",
            "x-route-group": "read"})
        assert r.status_code in (200, 429), r.text
    rls_trace = secrets.token_hex(16)
    with grpc.insecure_channel(f"{LOOPBACK}:{topology.rls_ports['eu'][0]}") as ch:
        D = ratelimit_pb2.RateLimitDescriptor
        meta = (("authorization", topology.gateway_headers()["Authorization"]),
                ("traceparent", f"00-{rls_trace}-00000000000000bb-01"))
        rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(rls_pb2.RateLimitRequest(
            domain="leasehold", descriptors=[D(entries=[D.Entry(key="tenant", value="atlas"),
                                                        D.Entry(key="user", value="U-5"),
                                                        D.Entry(key="route_group", value="read")])]),
            metadata=meta, timeout=5)

    decisions = wait_until(lambda: rec.find("leasehold-agent", "leasehold.decision", trace_id))
    assert decisions, "no decision span in the gateway's trace"
    a = attrs(decisions[0])
    assert a["leasehold.door"] == "http" and a["decision.source"] in ("script", "chunk", "negative_cache")
    assert a["leasehold.outcome"] in ("allowed", "denied") and a["leasehold.policy_version"] == 42
    assert decisions[0].parent_span_id == bytes.fromhex("0000000000000001")  # the gateway's span
    scripts = rec.find("leasehold-agent", "leasehold.script", trace_id)
    assert scripts and attrs(scripts[0])["leasehold.shard"] == "default"
    # spans reach the receiver in export batches, a script's often before its decision's (it ends
    # first): the decisions read above may predate some of the scripts' parents (bounded wait)
    parents = {sp.parent_span_id for sp in scripts}
    decisions = wait_until(lambda: _covering(rec.find("leasehold-agent", "leasehold.decision", trace_id), parents),
                           10.0) or decisions
    assert parents <= {d.span_id for d in decisions}

    # agent -> allocator: the agent's lease request span is a decision's child, the allocator's
    # request span is the agent's child, the commit belongs to the same trace (or links it)
    client = wait_until(lambda: rec.find("leasehold-agent", "leasehold.lease_request", trace_id))
    server = wait_until(lambda: rec.find("leasehold-allocator", "leasehold.lease_request", trace_id))
    assert client and server, f"no lease request in the trace after {sent} decisions"
    # the allocator's span ends (and is exported) before the agent's, which ends with the answer: the
    # agent's spans read above may predate some of the allocator's parents (bounded wait)
    callers = {s.parent_span_id for s in server}
    client = wait_until(lambda: _covering(rec.find("leasehold-agent", "leasehold.lease_request", trace_id), callers),
                        10.0) or client
    assert callers <= {c.span_id for c in client}
    commits = wait_until(lambda: [sp for sp in rec.find("leasehold-allocator", "leasehold.allocator_commit")
                                  if sp.trace_id == trace_id or any(lk.trace_id == trace_id for lk in sp.links)])
    assert commits and attrs(commits[0])["leasehold.kind"] in ("grants", "reports")

    for door, t in (("authz", authz_trace), ("rls", rls_trace)):
        got = wait_until(lambda t=t: rec.find("leasehold-agent", "leasehold.decision", bytes.fromhex(t)))
        assert got and attrs(got[0])["leasehold.door"] == door, door


def _region_headers(topology, trace_hex: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {topology.secrets.regions['eu']}",
            "traceparent": f"00-{trace_hex}-00000000000000cc-01"}


def test_a_regions_path_is_cut_short_on_the_allocators_span(receiver, topology):
    """A region's 14 KiB path (under the 16 KiB head limit) is kept as 256 characters on the
    allocator's request span, not whole."""
    rec, _ = receiver
    trace_hex = secrets.token_hex(16)
    path = "/v1/leases/" + "x" * 14_000 + "/usage"
    r = httpx.post(topology.allocator_urls[0] + path, json={}, headers=_region_headers(topology, trace_hex),
                   timeout=5)
    assert r.status_code in (400, 404), r.text  # authenticated; the lease id is refused
    spans = wait_until(lambda: rec.find("leasehold-allocator", "leasehold.lease_request", bytes.fromhex(trace_hex)))
    assert spans, "no allocator span for the request"
    assert attrs(spans[0])["url.path"] == path[:256]


def test_a_caller_the_allocator_does_not_authenticate_makes_no_span(receiver, topology):
    """The allocator opened its request span before the caller was authenticated: any client that
    reached the port, with no token or a wrong one, had its trace context and path exported to the
    collector. Only a region that passed authentication gets a span now; the others get their 401."""
    rec, _ = receiver
    url = topology.allocator_urls[0]
    refused = {}
    for name, auth in (("none", None), ("wrong", "Bearer " + secrets.token_urlsafe(32)),
                       ("gateway", topology.gateway_headers()["Authorization"])):
        trace_hex = secrets.token_hex(16)
        headers = {"traceparent": f"00-{trace_hex}-00000000000000dd-01", **({"Authorization": auth} if auth else {})}
        for method, path, body in (("POST", "/v1/leases", {}), ("POST", "/v1/leases/batch", {"requests": []}),
                                   ("POST", "/v1/usage/batch", {"reports": []}), ("GET", "/v1/leases/eu-0123456789", None)):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=5)
            assert r.status_code == 401, (name, path, r.text)
        refused[name] = bytes.fromhex(trace_hex)
    # then a region's request, whose span is exported after theirs would have been
    passed = secrets.token_hex(16)
    r = httpx.get(url + "/v1/leases/eu-0123456789", headers=_region_headers(topology, passed), timeout=5)
    assert r.status_code == 404, r.text
    assert wait_until(lambda: rec.find("leasehold-allocator", "leasehold.lease_request", bytes.fromhex(passed))), \
        "no allocator span for the region's request"
    time.sleep(1.0)  # one more export interval for anything still queued
    for name, trace_id in refused.items():
        assert not rec.find("leasehold-allocator", None, trace_id), name


def _traced_agent(tmp_path, redis_url: str, endpoint: str):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["LEASEHOLD_AGENT_PEPPER"] = "trace-test-pepper"
    proc = Proc("agent", agent_command(redis_url=redis_url, policy=DEFAULT_POLICY, region="eu", host=LOOPBACK,
                                       port=port, auth_disabled=True, otlp_endpoint=endpoint),
                tmp_path / "agent", env=env).start()
    url = f"http://{LOOPBACK}:{port}"
    wait_http_ready({url: proc}, timeout=30)
    return proc, url


def _admit(c: httpx.Client, rid: str, headers: list[tuple[str, str]]) -> None:
    r = c.post("/v1/admit", headers=headers, json={"requestId": rid, "tenantId": "birch",
                                                   "principal": {"type": "user", "id": "B-1"}, "routeGroup": "read"})
    assert r.status_code == 200, r.text


def test_a_clients_trace_context_is_taken_by_w3c_rules_and_cannot_flood_the_log(receiver, tmp_path, redis_url):
    """Through /v1/admit: a malformed or duplicated traceparent starts a new trace (never a 500);
    two tracestate fields are one list; a flood of malformed tracestates writes one log line (the
    opentelemetry package wrote a WARNING per request, naming the member)."""
    rec, endpoint = receiver
    proc, url = _traced_agent(tmp_path, redis_url, endpoint)
    a, b, hexa = "12345678901234567890123456789011", "12345678901234567890123456789012", "0af7651916cd43dd8448eb211c80319c"
    cases = {
        "trace-dup-parent": [("traceparent", f"00-{a}-1234567890123456-01"),
                             ("traceparent", f"00-{b}-1234567890123456-01")],
        "trace-two-states": [("traceparent", f"00-{a}-1234567890123456-01"), ("tracestate", "k1=v1"),
                             ("tracestate", "k2=v2")],
        "trace-version-ff": [("traceparent", f"ff-{b}-1234567890123456-01")],
        "trace-zero-trace": [("traceparent", f"00-{'0' * 32}-1234567890123456-01")],
        "trace-zero-span0": [("traceparent", f"00-{b}-{'0' * 16}-01")],
        "trace-v00-extras": [("traceparent", f"00-{b}-1234567890123456-01-00")],
        "trace-upper-case": [("traceparent", f"00-{hexa.upper()}-1234567890123456-01")],
    }
    flood = 200
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            for rid, headers in cases.items():
                _admit(c, rid, headers)
            for i in range(flood):
                _admit(c, f"trace-flood-{i:04d}", [("traceparent", f"00-{a}-1234567890123456-01"),
                                                   ("tracestate", f"not a member {i}," + "k=v," * 40)])

        def decided() -> dict | None:
            got = {attrs(sp)["leasehold.decision_id"]: sp for sp in rec.find("leasehold-agent", "leasehold.decision")
                   if attrs(sp)["leasehold.decision_id"] in cases}
            return got if len(got) == len(cases) else None
        spans = wait_until(decided)
    finally:
        proc.stop()
    assert spans, "the decision spans were not exported"
    for rid, sp in spans.items():
        if rid == "trace-two-states":
            assert sp.trace_id.hex() == a and sp.trace_state == "k1=v1,k2=v2", (sp.trace_id.hex(), sp.trace_state)
        else:  # a new trace: neither id sent, no parent
            assert sp.trace_id.hex() not in (a, b, hexa, "0" * 32) and not sp.parent_span_id, rid
    assert proc.log_path is not None
    warned = [ln for ln in proc.log_path.read_text().splitlines() if "doesn't match the w3c" in ln]
    assert 1 <= len(warned) <= 2 and all(len(ln) < 400 for ln in warned), warned  # the second: the count, 10 s on


def test_with_an_unreachable_collector_decisions_are_answered_and_the_exit_is_not_held(tmp_path, redis_url):
    """The collector's port refuses connections: decisions are answered while spans queue (the
    SDK's queue is bounded and drops the rest), and SIGTERM ends the agent within seconds (the
    SDK's flush retried each batch for up to 10 s: it took over 30 s)."""
    proc, url = _traced_agent(tmp_path, redis_url, f"http://{LOOPBACK}:{free_port()}")
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            for i in range(1_500):  # about 3 spans each: past the SDK's queue of 2,048
                _admit(c, f"unreached-{i:05d}", [])
        assert proc.popen is not None
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.popen.wait(60)
        took = time.monotonic() - started
    finally:
        proc.stop()
    assert took < 10, f"the agent took {took:.1f} s to exit"
