"""Both services answer every error class the same way (one HTTP exception mapper,
``kernel.http_errors``): the same status, the same ``application/problem+json`` body and the same
``WWW-Authenticate`` / ``Allow`` / ``Retry-After`` headers.

Both apps run in-process with their real stores (redis-server, etcd) and authentication on. Each
error class is raised from a probe route registered on each real app (so the answer is exactly what
the app's exception handling makes of it), and, where a service has one, reached through a real
route as a client would (malformed body, missing token, unknown route, wrong method, body too large,
wrong media type, invalid value). The agent's raw ASGI answers (the ``/v1/admit`` fast path and
``/v1/authz``) are compared with its handlers' answers."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from litestar import Litestar, get
from litestar.exceptions import HTTPException, TooManyRequestsException
from litestar.params import FromPath
from litestar.testing import AsyncTestClient

from allocator.app import create_app as create_allocator
from kernel.bundle import Pool
from kernel.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    LeaseholdError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    ValidationFailed,
)
from leasehold.local.procs import EtcdCluster
from region_agent.service.app import create_app as create_agent
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.allocator_app import lease_body, settings_for, unique_prefix
from tests.support.policies import northstar, write_bundle, write_pools
from tests.support.waiting import await_until

pytestmark = pytest.mark.integration

TOKEN = "error-answers-token"
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROBE = "/test/raise/{status:int}"
ERRORS: dict[int, LeaseholdError] = {
    400: BadRequest("bad"), 401: Unauthorized("who"), 403: Forbidden("no"), 404: NotFound("none"),
    405: MethodNotAllowed("not here", allow="POST"), 409: Conflict("clash"), 413: PayloadTooLarge("big"),
    415: UnsupportedMediaType("type"), 422: ValidationFailed("bad value", errors=["x: bad"]),
    429: TooManyRequests("slow down", extra={"retryAfterMs": 2_500}), 503: Unavailable("later"),
}
LITESTAR_ERRORS: dict[int, HTTPException] = {429: TooManyRequestsException("slow down")}


@get(PROBE, include_in_schema=False)
async def probe(status: FromPath[int]) -> None:
    raise ERRORS[status]


@get("/test/litestar/{status:int}", include_in_schema=False)
async def litestar_probe(status: FromPath[int]) -> None:
    raise LITESTAR_ERRORS[status]


@get("/test/crash", include_in_schema=False)
async def crash() -> None:
    raise RuntimeError("secret detail that must not leak")


def with_probes(app: Litestar) -> Litestar:
    for handler in (probe, litestar_probe, crash):
        app.register(handler)
    return app


@asynccontextmanager
async def both(redis_url: str, etcd: EtcdCluster, tmp: Path, *, fast_path: bool = True
               ) -> AsyncIterator[tuple[AsyncTestClient, AsyncTestClient]]:
    policy = tmp / "agent.json"
    write_bundle(policy, northstar())
    agent_app = with_probes(create_agent(
        make_settings(redis_url, policy, auth_disabled=False, gateway_tokens=[f"gw:{DIGEST}"],
                      operator_tokens=[f"ops:{DIGEST}"]), pepper=PEPPER, fast_path=fast_path))
    pools = write_pools(tmp / "pools.json", [Pool(id="p1", window_ms=60_000, limit=100, chunk_max=10,
                                                             regions=["eu", "us"])])
    alloc_app = with_probes(create_allocator(settings_for(etcd, pools, unique_prefix(), auth_disabled=False,
                                                          region_tokens=[f"eu:{DIGEST}"])))
    async with AsyncTestClient(app=agent_app) as agent, AsyncTestClient(app=alloc_app, timeout=30) as alloc:
        assert await await_until(lambda: alloc_app.state.election.is_leader), \
            "the allocator did not take the lead"
        yield agent, alloc


def shape(resp) -> dict:
    """What must agree between the services: status, media type, the error headers, the body's
    members and their values (``detail``, ``instance`` and the ``errors`` list aside, which describe
    the request)."""
    body = resp.json()
    return {"status": resp.status_code, "media": resp.headers["content-type"].split(";")[0],
            "headers": {h: resp.headers.get(h) for h in ("www-authenticate", "allow", "retry-after")},
            "members": sorted(body), "body": {k: v for k, v in body.items() if k not in ("detail", "instance", "errors")}}


@pytest.fixture
async def services(redis_url: str, etcd_cluster: EtcdCluster, tmp_path: Path):
    async with both(redis_url, etcd_cluster, tmp_path) as pair:
        yield pair


@pytest.mark.parametrize("status", sorted(ERRORS))
async def test_each_error_class_gets_the_same_answer_from_both_services(services, status: int):
    agent, alloc = services
    a = await agent.get(PROBE.replace("{status:int}", str(status)))
    b = await alloc.get(PROBE.replace("{status:int}", str(status)))
    assert a.status_code == b.status_code == status
    assert a.headers["content-type"] == b.headers["content-type"] == "application/problem+json"
    assert a.json() == b.json()  # the same path, so the whole body is the same
    body = a.json()
    assert body["status"] == status and body["type"] == "https://leasehold.dev/problems/" + ERRORS[status].code
    assert {h: a.headers.get(h) for h in ("www-authenticate", "allow", "retry-after")} == \
           {h: b.headers.get(h) for h in ("www-authenticate", "allow", "retry-after")}
    assert (a.headers.get("www-authenticate") == 'Bearer realm="leasehold"') is (status == 401)
    assert (a.headers.get("allow") == "POST") is (status == 405)
    retry = {429: "3", 503: "1"}.get(status)  # retryAfterMs 2,500 -> 3 s; no hint -> 1 s
    assert a.headers.get("retry-after") == retry and body["retriable"] is (retry is not None)


async def test_framework_errors_and_crashes_are_mapped_alike(services):
    agent, alloc = services
    a, b = await agent.get("/test/litestar/429"), await alloc.get("/test/litestar/429")
    assert shape(a) == shape(b) and a.status_code == 429 and a.headers["retry-after"] == "1"
    a, b = await agent.get("/test/crash"), await alloc.get("/test/crash")
    assert shape(a) == shape(b) and a.status_code == 500
    assert a.json()["detail"] == b.json()["detail"] == "internal error" and "secret" not in a.text + b.text


async def test_real_routes_give_the_same_shapes(services):
    """The same client mistake on each service's real routes."""
    agent, alloc = services
    lease = lease_body("err-lease-0001", "p1", "eu", 5)
    json_ct = {"content-type": "application/json"}
    cases = {
        400: (agent.post("/v1/admit", content=b"{not json", headers={**AUTH, **json_ct}),
              alloc.post("/v1/leases", content=b"{not json", headers={**AUTH, **json_ct})),
        401: (agent.post("/v1/admit", json=admit_body("err-000001")),
              alloc.post("/v1/leases", json=lease)),
        404: (agent.get("/v1/nothing-here", headers=AUTH), alloc.get("/v1/nothing-here", headers=AUTH)),
        405: (agent.get("/v1/admit", headers=AUTH), alloc.get("/v1/leases", headers=AUTH)),
        413: (agent.post("/v1/admit", content=b"{" + b" " * (3 * 1024 * 1024) + b"}", headers={**AUTH, **json_ct}),
              alloc.post("/v1/leases", content=b"{" + b" " * (3 * 1024 * 1024) + b"}", headers={**AUTH, **json_ct})),
        415: (agent.post("/v1/admit", content=b"{}", headers={**AUTH, "content-type": "text/plain"}),
              alloc.post("/v1/leases", content=b"{}", headers={**AUTH, "content-type": "text/plain"})),
        422: (agent.post("/v1/admit", headers=AUTH, json={**admit_body("err-000002", tenant=None, ptype="anonymous",
                                                                       pid="not-an-ip", api_key=None),
                                                          "routeGroup": "login"}),
              alloc.post("/v1/leases/batch", headers=AUTH, json={"requests": [lease, lease]})),
    }
    for status, (to_agent, to_alloc) in cases.items():
        a, b = await to_agent, await to_alloc
        assert a.status_code == b.status_code == status, (status, a.text, b.text)
        assert shape(a) == shape(b), status
    # 403: only the allocator has a natural one (a region asking for another's lease); the agent's
    # answer to the same class is its probe's
    b = await alloc.post("/v1/leases", headers=AUTH, json=lease_body("err-lease-0002", "p1", "us", 5))
    a = await agent.get(PROBE.replace("{status:int}", "403"))
    assert b.status_code == 403 and shape(a) == shape(b)
    # 405 names the methods the route has
    for allow in ((await agent.get("/v1/admit", headers=AUTH)).headers["allow"],
                  (await alloc.get("/v1/leases", headers=AUTH)).headers["allow"]):
        assert "POST" in allow.split(", ") and "GET" not in allow


async def test_schema_mismatch_is_validation_failed_with_each_services_documented_status(services):
    """The one per-service choice of the mapper: a body that does not fit the schema is 422 on
    the agent and 400 on the allocator (their documented APIs); the body has the same shape."""
    agent, alloc = services
    a = await agent.post("/v1/admit", headers=AUTH, json={**admit_body("err-000003"), "costHint": "many"})
    b = await alloc.post("/v1/leases", headers=AUTH, json={**lease_body("err-lease-0003", "p1", "eu", 5),
                                                           "want": "many"})
    assert (a.status_code, b.status_code) == (422, 400)
    for r in (a, b):
        body = r.json()
        assert body["type"].endswith("/validation-failed") and body["status"] == r.status_code
        assert body["errors"] and r.headers["content-type"] == "application/problem+json"
    assert sorted(a.json()) == sorted(b.json())


async def test_the_agents_raw_asgi_answers_are_its_handlers_answers(redis_url: str, etcd_cluster: EtcdCluster,
                                                                     tmp_path: Path):
    """The /v1/admit fast path and the /v1/authz route build their error answers with the same
    mapper: the same bytes as the Litestar handler (fast path off) for the same request."""
    bad = {**admit_body("err-000004", tenant=None, ptype="anonymous", pid="not-an-ip", api_key=None),
           "routeGroup": "login"}
    answers = []
    for fast in (True, False):
        (tmp_path / str(fast)).mkdir()
        async with both(redis_url, etcd_cluster, tmp_path / str(fast), fast_path=fast) as (agent, _):
            r = await agent.post("/v1/admit", headers=AUTH, json=bad)
            answers.append((r.status_code, r.headers.get("content-type"), r.content))
            if fast:
                authz = await agent.get("/v1/authz/catalog")  # no gateway token: the guard's 401
                admit = await agent.post("/v1/admit", json=admit_body("err-000005"))
                assert authz.status_code == admit.status_code == 401
                assert shape(authz) == shape(admit)
                assert authz.headers["www-authenticate"] == 'Bearer realm="leasehold"'
    assert answers[0] == answers[1] and answers[0][0] == 422
