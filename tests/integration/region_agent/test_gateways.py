"""The gateway front doors of an in-process agent against a real Redis: the RLS v3 gRPC server
(``--rls-port``, served in the app's own event loop) and ``/v1/authz``. They are the same
decision path as ``/v1/admit``: one user's P-READ bucket is shared by all three doors."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from litestar.testing import AsyncTestClient

from leasehold.local.procs import free_port
from region_agent.gateways import rls as rls_door
from region_agent.gateways.refused_callers import RefusedCallers
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, make_settings

pytestmark = pytest.mark.integration

TOKEN = "gw-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
META = (("authorization", f"Bearer {TOKEN}"),)
D = ratelimit_pb2.RateLimitDescriptor
R = rls_pb2.RateLimitResponse


def desc(*entries: tuple[str, str], hits: int | None = None) -> ratelimit_pb2.RateLimitDescriptor:
    d = D(entries=[D.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        d.hits_addend.value = hits
    return d


def user(u: str = "U-17", route: str = "read", tenant: str = "atlas") -> ratelimit_pb2.RateLimitDescriptor:
    return desc(("tenant", tenant), ("user", u), ("api_key", "K1"), ("route_group", route))


@pytest.fixture
def rls_port() -> int:
    return free_port()


@pytest.fixture
async def gw(redis_url: str, policy_file: Path,
             rls_port: int) -> AsyncIterator[tuple[AsyncTestClient, rls_pb2_grpc.RateLimitServiceStub]]:
    port = rls_port
    settings = make_settings(redis_url, policy_file, auth_disabled=False, rls_port=port,
                             gateway_tokens=["edge:" + hashlib.sha256(TOKEN.encode()).hexdigest()],
                             authz_route_prefixes=["/reports/export=export", "/login=login", "/=read"])
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield client, rls_pb2_grpc.RateLimitServiceStub(ch)


async def rls(stub, *descriptors, domain: str = "leasehold", hits: int = 0, metadata=META) -> R:
    return await stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain=domain, descriptors=list(descriptors),
                                                               hits_addend=hits), metadata=metadata, timeout=10)


async def metric(client: AsyncTestClient, name: str, **labels: str) -> float:
    total = 0.0
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


async def test_one_bucket_behind_three_doors(gw):
    """7 via RLS, 7 via /v1/admit, 6 via /v1/authz spend U-17's 20 tokens; the 21st is denied
    on each door with the same Retry-After and RateLimit fields."""
    client, stub = gw
    admit = {"requestId": "r-000000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17",
             "apiKeyId": "K1"}, "routeGroup": "read"}
    hdrs = {**AUTH, "x-tenant-id": "atlas", "x-user-id": "U-17", "x-api-key-id": "K1"}
    for _ in range(7):
        assert (await rls(stub, user())).overall_code == R.OK
    for i in range(7):
        d = (await client.post("/v1/admit", json={**admit, "requestId": f"r-00000010{i}"}, headers=AUTH)).json()
        assert d["allowed"]
    for _ in range(6):
        assert (await client.get("/v1/authz/catalog", headers=hdrs)).status_code == 200
    resp = await rls(stub, user())
    assert resp.overall_code == R.OVER_LIMIT
    (st,) = resp.statuses
    assert st.code == R.OVER_LIMIT and st.limit_remaining == 0
    assert (st.current_limit.name, st.current_limit.requests_per_unit, st.current_limit.unit) == \
        ("read-user-v3", 2, R.RateLimit.SECOND)
    # the store's hint, not a measured time: P-READ refills one token every 500 ms, so the next
    # one is due within one refill interval (docs/invariants.md P-READ)
    p_read_token_ms = 500
    assert st.duration_until_reset.ToMilliseconds() in range(1, p_read_token_ms + 1)
    headers = {h.key: h.value for h in resp.response_headers_to_add}
    assert headers == {"Retry-After": "1", "RateLimit-Policy": '"read-user-v3";q=20;w=10',
                       "RateLimit": '"read-user-v3";r=0;t=1', "content-type": "application/problem+json"}
    assert b'"status":429' in resp.raw_body
    assert resp.dynamic_metadata.fields["leasehold_status"].number_value == 429
    d = (await client.post("/v1/admit", json={**admit, "requestId": "r-000000200"}, headers=AUTH)).json()
    assert d["httpStatus"] == 429 and d["headers"]["RateLimit"] == headers["RateLimit"]
    a = await client.get("/v1/authz", headers={**hdrs, "x-route-group": "read"})
    assert a.status_code == 429 and a.headers["retry-after"] == "1" and a.headers["ratelimit"] == headers["RateLimit"]
    assert a.json()["status"] == 429
    assert await metric(client, "leasehold_agent_decisions_total", outcome="denied", rule="read-user-v3") == 3


async def test_allowed_status_and_hits_addend_cost(gw):
    client, stub = gw
    resp = await rls(stub, user("U-2"), hits=5)
    assert resp.overall_code == R.OK
    (st,) = resp.statuses
    assert st.code == R.OK and st.limit_remaining == 15 and st.current_limit.name == "read-user-v3"
    assert {h.key: h.value for h in resp.response_headers_to_add} == {
        "RateLimit-Policy": '"read-user-v3";q=20;w=10', "RateLimit": '"read-user-v3";r=15;t=0'}
    resp = await rls(stub, user("U-2", route="read"), desc(("remote_address", "203.0.113.9"), ("route_group", "login"),
                                                           hits=2))
    assert [s.code for s in resp.statuses] == [R.OK, R.OK]
    assert resp.statuses[0].limit_remaining == 14  # request-level hits_addend 0 = 1
    anon = resp.statuses[1]
    assert not anon.HasField("current_limit") and anon.limit_remaining == 0  # nothing for a pre-auth caller


async def test_several_descriptors_one_denial_decides(gw):
    client, stub = gw
    for attempt in range(3):  # P-ANON is a fixed window of 10 s: its 21 calls must fall in one
        address = f"198.51.100.{7 + attempt}"
        started = time.time()
        for _ in range(20):
            await rls(stub, desc(("remote_address", address), ("route_group", "login")))
        resp = await rls(stub, user("U-3"), desc(("remote_address", address), ("route_group", "login")))
        if started // 10 == time.time() // 10:
            break  # else a window boundary fell among them (a stall): again with a fresh address
    assert resp.overall_code == R.OVER_LIMIT
    assert [s.code for s in resp.statuses] == [R.OK, R.OVER_LIMIT]
    headers = {h.key: h.value for h in resp.response_headers_to_add}
    assert "RateLimit" not in headers and 1 <= int(headers["Retry-After"]) <= 10  # the anonymous denial's answer
    assert b"read-user-v3" not in resp.raw_body


@pytest.mark.parametrize(("descriptors", "domain", "reason"), [
    ([desc(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), ("header_match", "x"))], "leasehold", "unknown_key"),
    ([user()], "other", "unknown_domain"),
    ([], "leasehold", "no_descriptors"),
    ([user()] * 9, "leasehold", "too_many_descriptors"),
    ([desc(("tenant", "atlas"), ("user", "U-1"))], "leasehold", "missing_route_group"),
    ([desc(("user", "U-1"), ("route_group", "read"))], "leasehold", "missing_tenant"),
    ([desc(("tenant", "atlas"), ("route_group", "read"))], "leasehold", "missing_principal"),
    ([desc(("tenant", "atlas"), ("user", "U-1"), ("service", "S"), ("route_group", "read"))], "leasehold",
     "conflicting_principal"),
    ([desc(("tenant", "At}las"), ("user", "U-1"), ("route_group", "read"))], "leasehold", "bad_value"),
    ([desc(("remote_address", "not-an-ip"), ("route_group", "login"))], "leasehold", "bad_value"),
    ([desc(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), hits=0)], "leasehold", "bad_cost"),
    ([desc(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), hits=1001)], "leasehold", "bad_cost"),
    ([desc(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), ("tenant", "birch"))], "leasehold",
     "duplicate_key"),
])
async def test_unknown_or_malformed_descriptors_are_refused_and_counted(gw, descriptors, domain, reason):
    client, stub = gw
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rls(stub, *descriptors, domain=domain)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await metric(client, "leasehold_agent_rls_invalid_total", reason=reason) == 1
    assert await metric(client, "leasehold_agent_rls_requests_total", outcome="invalid") == 1
    assert await metric(client, "leasehold_agent_decisions_total") == 0  # nothing was decided


async def test_bytes_that_are_not_a_request_are_refused_and_counted(gw, rls_port):
    """The door reads a call's bytes itself (it remembers calls by their bytes): bytes that do not
    parse as a RateLimitRequest are INVALID_ARGUMENT, counted as ``undecodable`` — never an
    internal error, which Envoy's ``failure_mode_deny: false`` would let through."""
    client, _ = gw
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rls_port}") as ch:
        raw = ch.unary_unary("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")  # bytes in, bytes out
        for garbage in (b"\xff\xff\xff", b"\x0a\x05le"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await raw(garbage, metadata=META, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # and a well-formed call's bytes through the same raw channel are answered
        ok = R.FromString(await raw(rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[user("U-raw")])
                                    .SerializeToString(), metadata=META, timeout=10))
    assert ok.overall_code == R.OK
    assert await metric(client, "leasehold_agent_rls_invalid_total", reason="undecodable") == 2
    assert await metric(client, "leasehold_agent_decisions_total") == 1


async def test_the_same_call_again_is_a_new_decision_unless_it_names_its_request_id(gw):
    """Envoy sends the same bytes for the same caller each time. Each such call is a decision of
    its own (P-READ: 20, then 2/s — the user's remaining count falls call by call); a call whose
    descriptor names its request id is the same decision again (an idempotent rule's record),
    charged once."""
    client, stub = gw
    remaining = [(await rls(stub, user("U-again"))).statuses[0].limit_remaining for _ in range(3)]
    assert remaining == [19, 18, 17]
    two = [[s.limit_remaining for s in (await rls(stub, user("U-again2"), user("U-again2"))).statuses]
           for _ in range(2)]
    assert two == [[19, 18], [17, 16]]  # two descriptors, two decisions per call, every call
    named = desc(("tenant", "atlas"), ("user", "U-again3"), ("route_group", "export"), ("request_id", "rid-again-01"))
    first, again = [await rls(stub, named) for _ in range(2)]
    assert first.overall_code == again.overall_code == R.OK
    assert again.statuses[0].limit_remaining == first.statuses[0].limit_remaining  # the recorded decision
    assert await metric(client, "leasehold_agent_rls_requests_total", outcome="ok") == 7


async def test_limit_override_is_refused(gw):
    client, stub = gw
    d = user()
    d.limit.requests_per_unit = 1_000_000
    d.limit.unit = R.RateLimit.SECOND
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rls(stub, d)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await metric(client, "leasehold_agent_rls_invalid_total", reason="limit_override") == 1


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-token-xxxxxxxx"),),
                                      (("authorization", TOKEN),)])
async def test_rls_needs_the_gateway_token(gw, metadata, monkeypatch, caplog):
    client, stub = gw
    monkeypatch.setattr(rls_door, "refused_callers", RefusedCallers(rls_door.log))
    with caplog.at_level(logging.WARNING, logger=rls_door.log.name), pytest.raises(grpc.aio.AioRpcError) as e:
        await rls(stub, user(), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await metric(client, "leasehold_agent_rls_requests_total", outcome="unauthenticated") == 1
    assert await metric(client, "leasehold_agent_decisions_total") == 0
    # the agent's log names the caller (LeaseholdRlsUnknownCaller's runbook reads it)
    assert [r.getMessage() for r in caplog.records if r.name == rls_door.log.name] == [
        "RLS call refused: no valid gateway token, from 127.0.0.1"]


@pytest.mark.parametrize("metadata", [META + META, (("authorization", f"bearer {TOKEN}"),),
                                      (("authorization-bin", f"Bearer {TOKEN}".encode()),),
                                      (("x-leasehold-authorization", f"Bearer {TOKEN}"),)],
                         ids=["two-entries", "lowercase-scheme", "binary-entry", "another-name"])
async def test_the_token_is_read_from_one_authorization_entry_only(gw, metadata):
    """A client trying the metadata: two tokens (which one a reader takes would depend on it),
    the scheme spelled otherwise, the token in a binary entry or under another name — all refused."""
    client, stub = gw
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rls(stub, user(), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await metric(client, "leasehold_agent_decisions_total") == 0


async def test_a_message_or_metadata_too_large_is_refused_by_grpc_before_the_agent(gw, rls_port):
    client, stub = gw
    big = desc(("tenant", "atlas"), ("user", "x" * (4 << 20)), ("route_group", "read"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rls_port}",
                                         options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await rls(rls_pb2_grpc.RateLimitServiceStub(ch), big)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rls(stub, user(), metadata=(*META, ("x-junk", "j" * 20_000)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await metric(client, "leasehold_agent_rls_requests_total") == 0  # never reached the agent
    assert (await rls(stub, user())).overall_code == R.OK  # and the connection still answers


async def test_the_port_serves_its_services_and_health_only(gw, rls_port):
    """No reflection, no other service: a method the port does not serve is UNIMPLEMENTED, with or
    without a token; health answers for the services it serves, NOT_FOUND for any other."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{rls_port}") as ch:
        for method in ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                       "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                       "/envoy.service.ratelimit.v3.RateLimitService/Other", "/x.Y/Z"):
            for metadata in ((), META):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(method)(b"", metadata=metadata, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        check = health_pb2_grpc.HealthStub(ch).Check
        for name in ("", "envoy.service.ratelimit.v3.RateLimitService"):
            assert (await check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await check(health_pb2.HealthCheckRequest(service="grpc.reflection.v1.ServerReflection"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_authz_questions_from_headers(gw):
    client, _ = gw
    base = {**AUTH, "x-tenant-id": "atlas", "x-user-id": "U-5"}
    # the route group from the route-prefix map over X-Forwarded-Uri (Traefik) or the appended path (Envoy)
    r = await client.get("/v1/authz", headers={**base, "x-forwarded-uri": "/reports/export/q3?x=1"})
    assert r.status_code == 200 and "ratelimit" not in r.headers  # export is a tenant rule: no RateLimit fields
    r = await client.request("DELETE", "/v1/authz/catalog/items", headers=base)
    assert r.status_code == 200 and r.headers["ratelimit"] == '"read-user-v3";r=19;t=0' and r.content == b""
    r = await client.head("/v1/authz/catalog", headers={**base, "x-leasehold-cost": "4"})
    assert r.status_code == 200 and r.headers["ratelimit"] == '"read-user-v3";r=15;t=0'
    # a gateway that forwards the client's own Authorization sends its token in X-Leasehold-Authorization
    r = await client.get("/v1/authz/catalog", headers={**base, "authorization": "Bearer the-clients-own-jwt",
                                                         "x-leasehold-authorization": AUTH["authorization"]})
    assert r.status_code == 200
    r = await client.get("/v1/authz/catalog", headers={**base, "authorization": "Bearer the-clients-own-jwt"})
    assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
    # nginx: denials as 403 with the real status beside it. U-5's bucket refills 2 tokens a second
    # while it is spent, so how many requests it takes to empty it depends on how fast they come (a
    # loaded machine refilled 3 tokens before the 17th, allowed): asked until it denies (bounded)
    codes = []
    for _ in range(100):
        r = await client.get("/v1/authz/catalog", headers={**base, "x-leasehold-deny-status": "403"})
        codes.append(r.status_code)
        if r.status_code != 200:
            break
    assert r.status_code == 403 and r.headers["x-leasehold-status"] == "429" and r.headers["retry-after"] == "1", codes


async def test_a_path_beside_the_door_is_not_the_door(gw):
    """The door is ``/v1/authz`` and what is below it; ``/v1/authzfoo`` shares only a prefix."""
    client, _ = gw
    base = {**AUTH, "x-tenant-id": "atlas", "x-user-id": "U-5"}
    for path in ("/v1/authzfoo", "/v1/authz.json", "/v1/authzcatalog/items"):
        r = await client.get(path, headers=base)
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json", (path, r.text)
    assert await metric(client, "leasehold_agent_decisions_total") == 0
    assert (await client.get("/v1/authz/catalog", headers=base)).status_code == 200


@pytest.mark.parametrize(("headers", "status", "reason"), [
    ({"x-tenant-id": "atlas", "x-user-id": "U-6", "x-leasehold-cost": "0"}, 422, "bad_cost"),
    ({"x-tenant-id": "atlas", "x-user-id": "U-6", "x-leasehold-cost": "12a"}, 422, "bad_cost"),
    ({"x-tenant-id": "atlas"}, 422, "missing_principal"),
    ({"x-user-id": "U-6"}, 422, "missing_tenant"),
    ({"x-tenant-id": "ATLAS", "x-user-id": "U-6"}, 422, "bad_value"),
    ({"x-real-ip": "999.1.1.1"}, 422, "bad_value"),
    ({"x-tenant-id": "atlas", "x-user-id": "U-6", "x-leasehold-deny-status": "200"}, 400, None),
    ({"x-tenant-id": "atlas", "x-user-id": "U-6", "x-request-id": "short"}, 422, "bad_value"),
])
async def test_authz_malformed_questions_are_problems(gw, headers, status, reason):
    client, _ = gw
    r = await client.get("/v1/authz/catalog", headers={**AUTH, **headers})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json" and r.json()["status"] == status
    if reason:
        assert await metric(client, "leasehold_agent_authz_invalid_total", reason=reason) == 1
    assert await metric(client, "leasehold_agent_decisions_total") == 0


async def test_a_replayed_request_id_is_a_denial_on_every_door_never_an_error(gw):
    """An idempotent rule (export) keeps a decision record per request id. The same id asked by
    another user is a decision on every door: /v1/admit 409, forward auth 409, the rate limit
    service OVER_LIMIT with the 409 problem (a gRPC error there is what Envoy's
    ``failure_mode_deny: false`` lets through) — one descriptor or several."""
    client, stub = gw

    def export(u: str, rid: str) -> ratelimit_pb2.RateLimitDescriptor:
        return desc(("tenant", "atlas"), ("user", u), ("route_group", "export"), ("request_id", rid))

    first = await rls(stub, export("U-1", "rid-replayed-01"))
    assert first.overall_code == R.OK
    again = await rls(stub, export("U-2", "rid-replayed-01"))  # was gRPC INTERNAL: Envoy passed it
    assert again.overall_code == R.OVER_LIMIT and [s.code for s in again.statuses] == [R.OVER_LIMIT]
    assert b'"status":409' in again.raw_body and b"decision-conflict" in again.raw_body
    assert again.dynamic_metadata["leasehold_status"] == 409
    assert await metric(client, "leasehold_agent_rls_requests_total", outcome="conflict_409") == 1
    # with a second descriptor in the call (the batch path) the answer is the same denial
    two = await rls(stub, export("U-3", "rid-replayed-02"), user("U-3"))
    assert two.overall_code == R.OK
    two_again = await rls(stub, export("U-4", "rid-replayed-02"), user("U-4"))
    assert two_again.overall_code == R.OVER_LIMIT
    assert [s.code for s in two_again.statuses] == [R.OVER_LIMIT, R.OK]
    # forward auth and /v1/admit: 409 problems for a replayed id
    hdrs = {**AUTH, "x-tenant-id": "atlas", "x-user-id": "U-5", "x-request-id": "rid-replayed-03"}
    assert (await client.get("/v1/authz/reports/export", headers=hdrs)).status_code == 200
    r = await client.get("/v1/authz/reports/export", headers={**hdrs, "x-user-id": "U-6"})
    assert r.status_code == 409 and r.json()["type"].endswith("/decision-conflict")
    body = {"requestId": "rid-replayed-01", "tenantId": "atlas", "principal": {"type": "user", "id": "U-7"},
            "routeGroup": "export"}
    r = await client.post("/v1/admit", json=body, headers=AUTH)
    assert r.status_code == 409 and r.json()["decisionId"] == "rid-replayed-01"


@pytest.fixture
async def gw_grouped(redis_url: str, policy_file: Path):
    """The RLS door with a long group linger (20 ms), so concurrent calls are held and decided
    together even when the machine is busy."""
    port = free_port()
    settings = make_settings(redis_url, policy_file, rls_port=port, rls_group_linger_ms=20)
    app = create_app(settings, pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield client, rls_pb2_grpc.RateLimitServiceStub(ch)


def _answer(resp: R) -> tuple:
    """An answer without the user's own name (the RateLimit fields name the rule, not the user)."""
    return (resp.overall_code, [(s.code, s.limit_remaining, s.current_limit.name, s.current_limit.requests_per_unit,
                                 s.current_limit.unit) for s in resp.statuses],
            sorted((h.key, h.value) for h in resp.response_headers_to_add), resp.raw_body)


async def test_calls_decided_together_answer_as_calls_alone(gw_grouped):
    """Concurrent calls held in a group are decided in one admission and get exactly the answer
    each would get alone: a fresh user's first call, and a burst on one user debits its bucket once
    per call (P-READ: 20, then 2/s)."""
    import asyncio

    client, stub = gw_grouped
    alone = await rls(stub, user("U-alone"), metadata=())
    assert alone.overall_code == R.OK and alone.statuses[0].limit_remaining == 19
    assert await metric(client, "leasehold_agent_rls_group_calls_count") == 0  # a call alone is never held
    # calls are held only when they overlap: whether 24 concurrent calls do depends on how soon grpcio hands
    # each to the loop against how soon the one before it is answered, so rounds of fresh users are sent
    # until a group held more than one call (bounded); every round's answers are checked
    n, sent = 24, 0
    for rnd in range(10):
        answers = await asyncio.gather(*(rls(stub, user(f"U-group-{rnd}-{i}"), metadata=()) for i in range(n)))
        sent += n
        assert [_answer(a) for a in answers] == [_answer(alone)] * n
        groups = await metric(client, "leasehold_agent_rls_group_calls_count")
        grouped = await metric(client, "leasehold_agent_rls_group_calls_sum")
        if grouped > groups:
            break
    assert 1 <= groups < grouped <= sent  # calls were decided together

    started = time.monotonic()
    burst = await asyncio.gather(*(rls(stub, user("U-burst"), metadata=()) for _ in range(30)))
    refilled = int(2 * (time.monotonic() - started)) + 1  # 2/s while the burst was answered, rounded up
    ok = sorted(a.statuses[0].limit_remaining for a in burst if a.overall_code == R.OK)
    assert 20 <= len(ok) <= 20 + refilled
    assert all(a.overall_code == R.OVER_LIMIT for a in burst if a.overall_code != R.OK)
    assert len(set(ok)) >= len(ok) - refilled  # each admitted call saw its own debit (remaining counts down)
