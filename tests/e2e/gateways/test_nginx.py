"""A real nginx (Debian's package) with ``auth_request`` to the agent's ``/v1/authz``
(``deploy/gateways/nginx.conf``): auth_request understands only 2xx/401/403, and the config turns
the agent's 403 + X-Leasehold-Status back into the 429 / 503 with Retry-After the client sees."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from leasehold.local.gateways import Nginx
from tests.support.cgi_backend import CgiBackend
from tests.support.upgrade_backend import UpgradeBackend

from . import attacks
from .conftest import Stack, assert_p_read, identity, in_front_of, the_backend_ends_its_export

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bearer_at_the_agent() -> bool:
    return True  # nginx.conf hands the client's token to the agent (--authz-jwks)


@pytest.fixture(scope="module")
def nginx(stack: Stack) -> Iterator[Nginx]:
    n = stack.nginx()
    yield n
    n.stop()


def test_p_read_through_nginx_auth_request(stack: Stack, nginx: Nginx):
    stack.full_frozen_bucket("U-17")
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        responses = [c.get("/catalog?page=2", headers=identity("U-17")) for _ in range(21)]
    assert_p_read(responses)
    denied = responses[20]
    assert denied.headers["content-type"] == "application/problem+json"
    assert denied.json()["status"] == 429
    # the agent saw every question, and answered the denial as 403 for nginx
    assert stack.metric("leasehold_agent_authz_requests_total", status="200") >= 20
    assert stack.metric("leasehold_agent_authz_requests_total", status="403") >= 1


def test_redis_stopped_per_rule_fail_modes_through_nginx(stack: Stack, nginx: Nginx):
    stack.redis.stop()
    try:
        with httpx.Client(base_url=nginx.url, timeout=10) as c:
            reads = [c.get("/catalog", headers=identity("U-42")) for _ in range(6)]
            assert [r.status_code for r in reads] == [200] * 5 + [429]
            assert "retry-after" in reads[5].headers
            export = c.post("/reports/export", headers=identity("U-42"))
            assert export.status_code == 503 and export.headers["retry-after"] in ("5", "6")
    finally:
        stack.redis.start()


def test_agent_unreachable_is_a_503_not_a_500(stack: Stack, nginx: Nginx):
    """auth_request turns a failed subrequest into 500; the config answers 503 + Retry-After."""
    stack.agent.signal(19)  # SIGSTOP: connections hang, the subrequest times out
    try:
        with httpx.Client(base_url=nginx.url, timeout=10) as c:
            r = c.get("/catalog", headers=identity("U-43"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        stack.agent.signal(18)  # SIGCONT


def test_hostile_headers_change_nothing(stack: Stack, nginx: Nginx):
    """Every hostile header on every request: the verified user's P-READ numbers exactly."""
    attacks.p_read_with_hostile_headers(stack, nginx.url, "U-30", ratelimit_on_200=True)


def test_without_a_valid_token_identity_headers_name_nobody(stack: Stack, nginx: Nginx):
    attacks.no_token_claims_nothing(stack, nginx.url)


def test_the_route_group_is_the_locations(stack: Stack, nginx: Nginx):
    attacks.route_group_is_the_routes(stack, nginx.url, "rgnginx")


def test_a_clients_request_id_is_never_the_decision_id(stack: Stack, nginx: Nginx):
    attacks.replayed_request_id_is_not_the_clients(stack, nginx.url, "ridnginx")


def test_forged_forwarding_headers_count_the_connections_address(stack: Stack, nginx: Nginx):
    attacks.forged_forwarding_headers_count_the_connection(stack, nginx.url, "127.0.4.3")


def test_the_anonymous_route_is_login_alone(stack: Stack, nginx: Nginx):
    attacks.the_anonymous_route_is_login_alone(nginx.url, "127.0.5.3")


def test_one_token_is_one_identity_however_spelled(stack: Stack, nginx: Nginx):
    attacks.one_token_is_one_identity(stack, nginx.url, "spnginx")


def test_unkeyable_claims_are_refused(stack: Stack, nginx: Nginx):
    attacks.unkeyable_claims_are_refused(stack, nginx.url)


def test_claims_that_are_no_header_value_are_refused(stack: Stack, nginx: Nginx):
    attacks.claims_that_are_no_header_value_are_refused(stack, nginx.url, "txnginx", "127.0.8.3", status=422)


def test_ambiguous_paths_never_reach_the_backend(stack: Stack, nginx: Nginx):
    attacks.ambiguous_paths_never_reach_the_backend(nginx.url, "127.0.6.3", "ambnginx")


def test_the_backend_gets_the_verified_identity_only(stack: Stack, nginx: Nginx):
    attacks.the_backend_gets_the_verified_identity_only(nginx.url, "idnginx", "127.0.7.3")


def test_alias_headers_name_nobody_at_a_cgi_backend(stack: Stack):
    with in_front_of(CgiBackend(), stack.nginx, "nginx-cgi") as g:
        attacks.alias_headers_name_nobody(g.url, "aliasnginx")


@pytest.mark.parametrize("kind", sorted(attacks.UPGRADES))
def test_an_upgrade_opens_no_tunnel(stack: Stack, kind: str):
    backend = UpgradeBackend()
    with in_front_of(backend, stack.nginx, "nginx-upgrade-" + kind) as g:
        attacks.an_upgrade_opens_no_tunnel(g.url, backend, "upgnginx" + kind, kind)


def test_the_backend_ends_its_export(stack: Stack, nginx: Nginx):
    """The backend behind nginx.conf is handed the decision id ($request_id) and ends the export's
    concurrency slot with it."""
    the_backend_ends_its_export(stack, nginx.url, "relnginx")
