"""Every door's decisions are traced by the one admission (region_agent.decision.admission), with the SDK's
in-memory exporter, against a real Redis: ``POST /v1/admit`` and ``/v1/admit/batch`` through the
fast path and through the Litestar handlers, ``/v1/authz`` and the RLS gRPC call. Each call that
carries a gateway's ``traceparent`` gives exactly one ``leasehold.decision`` span, child of the
gateway's span, naming its door (no door wraps a second span of its own)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kernel import logs, tracing
from leasehold.local.procs import free_port
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings

pytestmark = pytest.mark.integration

TOKEN = "gw-token-for-the-door-spans"
AUTH = {"authorization": f"Bearer {TOKEN}"}
GATEWAY_SPAN = "00000000000000c1"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process for the module (a tracer provider is set once per process, and
    kept across the apps' shutdowns)."""
    exp = InMemorySpanExporter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracing, "shutdown", lambda: None)
        assert tracing.setup("leasehold-agent", None, exporter=exp)
        try:
            yield exp
        finally:
            tracing.ENABLED = False
            logs.set_trace_ids(None)


def traceparent() -> tuple[str, int]:
    trace = secrets.token_hex(16)
    return f"00-{trace}-{GATEWAY_SPAN}-01", int(trace, 16)


def decision_spans(exp: InMemorySpanExporter, trace_id: int) -> list:
    return [s for s in exp.get_finished_spans() if s.name == "leasehold.decision" and s.context.trace_id == trace_id]


def assert_one_door_span(exp: InMemorySpanExporter, trace_id: int, door: str, decisions: int = 1) -> None:
    (span,) = decision_spans(exp, trace_id)
    assert span.parent is not None and span.parent.span_id == int(GATEWAY_SPAN, 16), "child of the gateway's span"
    assert span.attributes["leasehold.door"] == door
    assert span.attributes["leasehold.decisions"] == decisions
    assert span.attributes["decision.source"] in ("script", "policy")


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast path", "litestar handlers"])
async def test_admit_and_batch_are_traced_on_both_paths(exporter, redis_url: str, policy_file: Path,
                                                        fast_path: bool):
    settings = make_settings(redis_url, policy_file, auth_disabled=False,
                             gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()])
    app = create_app(settings, pepper=PEPPER, fast_path=fast_path)
    tag = "f" if fast_path else "s"
    async with AsyncTestClient(app=app) as c:
        tp, one = traceparent()
        r = await c.post("/v1/admit", json=admit_body(f"ds-{tag}-one-0001"), headers={**AUTH, "traceparent": tp})
        assert r.status_code == 200, r.text
        tp, batch = traceparent()
        r = await c.post("/v1/admit/batch", headers={**AUTH, "traceparent": tp}, json={"requests": [
            admit_body(f"ds-{tag}-bat-0001"), admit_body(f"ds-{tag}-bat-0002", pid="U-2")]})
        assert r.status_code == 200, r.text
    assert_one_door_span(exporter, one, "http")
    assert_one_door_span(exporter, batch, "http", decisions=2)


async def test_forward_auth_and_rls_are_traced(exporter, redis_url: str, policy_file: Path):
    port = free_port()
    settings = make_settings(redis_url, policy_file, auth_disabled=False, rls_port=port,
                             gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()],
                             authz_route_prefixes=["/=read"])
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as c:
        tp, authz = traceparent()
        r = await c.get("/v1/authz/catalog", headers={**AUTH, "traceparent": tp, "x-tenant-id": "atlas",
                                                      "x-user-id": "U-40", "x-real-ip": "192.0.2.1"})
        assert r.status_code == 200, r.text
        tp, rls = traceparent()
        D = ratelimit_pb2.RateLimitDescriptor
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = await rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(rls_pb2.RateLimitRequest(
                domain="leasehold", descriptors=[D(entries=[D.Entry(key="tenant", value="atlas"),
                                                            D.Entry(key="user", value="U-41"),
                                                            D.Entry(key="route_group", value="read")])]),
                metadata=(*AUTH.items(), ("traceparent", tp)), timeout=10)
        assert resp.overall_code == rls_pb2.RateLimitResponse.OK
    assert_one_door_span(exporter, authz, "authz")
    assert_one_door_span(exporter, rls, "rls")
