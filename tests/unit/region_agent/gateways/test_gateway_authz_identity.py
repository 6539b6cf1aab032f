"""region_agent.gateways.authz: what an allowed forward-auth answer hands the backend. With
``--authz-jwks`` the 200 carries the identity the agent verified (X-Tenant-Id, X-User-Id,
X-Api-Key-Id when the token names a key), for nginx and Traefik to set on the request in place of
the client's copies; nothing on a denial, on a pre-authentication route, without a valid token,
or when the agent only read headers a gateway sent. Every allowed answer also carries the decision
id it was decided under (X-Request-Id: the gateway's, else the agent's own), for the backend to end
an export's concurrency slot with; no refusal does. The raw ASGI handler is driven as uvicorn
drives it, with a recording ``send``."""

from __future__ import annotations

import pytest

from region_agent.gateways.authz import identity_headers
from region_agent.gateways.bearer import BearerVerifier, Identity
from region_agent.gateways.mapping import Names
from tests.support.authz_door import ISSUER, FakeGateways, ask, token

IDENTITY = (b"x-tenant-id", b"x-user-id", b"x-api-key-id", b"x-service-id", b"x-route-group")
FORGED = [(b"x-tenant-id", b"birch"), (b"x-user-id", b"admin"), (b"x-api-key-id", b"KX"),
          (b"x-service-id", b"svc")]


@pytest.fixture
def verifier(tmp_path) -> BearerVerifier:
    return BearerVerifier(str(ISSUER.write_jwks(tmp_path / "jwks.json")), issuer=ISSUER.issuer,
                          audience=ISSUER.audience)


def handed_on(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() in IDENTITY]




def test_an_allowed_request_hands_on_the_tokens_identity_not_the_clients(verifier):
    gw = FakeGateways(verifier)
    status, headers = ask(gw, [*FORGED, token("U-17")])
    assert status == 200
    assert handed_on(headers) == [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-17"), (b"x-api-key-id", b"K1")]
    assert (b"RateLimit", b'"read-user-v3";r=19;t=0') in headers  # the answer's own fields stay
    assert gw.asked[0].tenant_id == "atlas" and gw.asked[0].principal.id == "U-17"
    status, headers = ask(gw, [*FORGED, token("U-18", key=None)])
    assert status == 200 and handed_on(headers) == [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-18")]


def test_nothing_is_handed_on_without_a_verified_allowed_request(verifier):
    # a pre-authentication route: the address alone, a valid token or not
    assert handed_on(ask(FakeGateways(verifier), [*FORGED, token("U-17")], route="login")[1]) == []
    # no token, a bad one: 401
    for extra in ([], [(b"authorization", b"Bearer not.a.jwt")]):
        status, headers = ask(FakeGateways(verifier), [*FORGED, *extra])
        assert status == 401 and handed_on(headers) == [], extra
    # denied: 429, or 403 for nginx's auth_request
    status, headers = ask(FakeGateways(verifier, status=429), [token("U-17")])
    assert status == 429 and handed_on(headers) == []
    status, headers = ask(FakeGateways(verifier, status=429), [token("U-17"), (b"x-leasehold-deny-status", b"403")])
    assert status == 403 and handed_on(headers) == []
    # without --authz-jwks the agent verified nothing: the gateway's identity headers are read, never echoed
    gw = FakeGateways(None)
    status, headers = ask(gw, [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-19")])
    assert status == 200 and handed_on(headers) == [] and gw.asked[0].principal.id == "U-19"


def test_the_names_are_the_questions_and_the_values_utf8(verifier):
    gw = FakeGateways(verifier, names=Names.build(authz_headers=["tenant=x-org-id", "user=x-principal"]))
    status, headers = ask(gw, [token("Zoë", key=None)])
    assert status == 200
    assert [(k, v) for k, v in headers if k in (b"x-org-id", b"x-principal")] == [
        (b"x-org-id", b"atlas"), (b"x-principal", "Zoë".encode())]
    assert handed_on(headers) == []


@pytest.mark.parametrize("user", [" admin", "admin ", "U-1\r\nx-tenant-id: birch", "U\x00", "U\t", "U\x7f"])
def test_a_claim_that_is_no_header_value_is_refused_before_anything_is_spent(verifier, user):
    """A backend trims " admin" into another principal; a control character is no header value
    (uvicorn refuses to send one, no gateway forwards one). A 422 problem, as for a claim no
    question can carry, and nothing asked or spent."""
    gw = FakeGateways(verifier)
    status, headers = ask(gw, [token(user)])
    assert status == 422 and handed_on(headers) == [] and gw.asked == []
    assert (b"content-type", b"application/problem+json") in headers


def test_the_bytes_of_an_identity_are_built_once(verifier, monkeypatch):
    import region_agent.gateways.authz as door

    built: list[Identity] = []

    def counting(names: Names, who: Identity) -> tuple:
        built.append(who)
        return identity_headers(names, who)

    monkeypatch.setattr(door, "identity_headers", counting)
    gw = FakeGateways(verifier)
    answers = [handed_on(ask(gw, [token("U-17")])[1]) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2] and built == [Identity("atlas", "U-17", "K1")]
    ask(gw, [token("U-17", key=None)])
    assert len(built) == 2 and len(gw.identity_answers) == 2
    ask(gw, [token(" U-17")])  # refused as a question: never built, never remembered
    assert len(built) == 2 and len(gw.identity_answers) == 2


def decision_id(headers: list[tuple[bytes, bytes]], name: bytes = b"x-request-id") -> list[bytes]:
    return [v for k, v in headers if k == name]


def test_an_allowed_request_hands_on_its_decision_id(verifier):
    """The 200 carries the id the request was decided under, for the backend to end an export's
    concurrency slot with (``POST /v1/release``): the one the agent minted when the gateway sent
    none (Traefik), else the gateway's own (nginx's ``$request_id``, Envoy's ``x-request-id``)."""
    gw = FakeGateways(verifier)
    status, headers = ask(gw, [token("U-17")])
    assert status == 200 and decision_id(headers) == [gw.asked[-1].request_id.encode()]
    assert gw.asked[-1].request_id.startswith("authz-")
    status, headers = ask(gw, [token("U-17"), (b"x-request-id", b"nginx-0123456789abcdef")])
    assert status == 200 and decision_id(headers) == [b"nginx-0123456789abcdef"]
    # a pre-authentication route is decided under an id too
    status, headers = ask(gw, [], route="login")
    assert status == 200 and decision_id(headers) == [gw.asked[-1].request_id.encode()]
    # without --authz-jwks (Envoy ext_authz: its own x-request-id)
    gw = FakeGateways(None)
    status, headers = ask(gw, [(b"x-tenant-id", b"atlas"), (b"x-user-id", b"U-19"), (b"x-request-id", b"envoy-0a1b2c3d")])
    assert status == 200 and decision_id(headers) == [b"envoy-0a1b2c3d"]


def test_the_decision_id_goes_under_the_questions_name_and_never_on_a_refusal(verifier):
    names = Names.build(authz_headers=["request_id=x-trace-id"])
    gw = FakeGateways(verifier, names=names)
    status, headers = ask(gw, [token("U-17"), (b"x-request-id", b"client-chosen-id-0001")])
    assert status == 200 and decision_id(headers) == []  # x-request-id is no question's field here
    assert decision_id(headers, b"x-trace-id") == [gw.asked[-1].request_id.encode()]
    assert gw.asked[-1].request_id != "client-chosen-id-0001"
    for gw, extra in ((FakeGateways(verifier, status=429), [token("U-17")]),
                      (FakeGateways(verifier, status=429), [token("U-17"), (b"x-leasehold-deny-status", b"403")]),
                      (FakeGateways(verifier), []),  # no token: 401
                      (FakeGateways(verifier), [token(" admin")])):  # a claim that is no header value: 422
        status, headers = ask(gw, [*extra, (b"x-request-id", b"gateway-0123456789")])
        assert status in (401, 403, 422, 429) and decision_id(headers) == [], (status, headers)
