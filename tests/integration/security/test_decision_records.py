"""A decision record answers only the question it was written for (docs/security.md), on the
agent as a real process with authentication on: the same requestId from another principal, for
another cost or on behalf of another tenant is a 409 problem (a batch item carries
``httpStatus: 409``, ``reason: REQUEST_ID_CONFLICT``), never the stored allow, and it charges
nothing and does not pass the concurrency gate; the original caller's retry still replays."""

from __future__ import annotations

import httpx
import pytest
import redis

from .conftest import Service

pytestmark = pytest.mark.integration

TENANT = "gamma"  # its own keys: the other tests of the package use atlas
GATE = f"rl:v3:{{t:{TENANT}}}:tenant:{TENANT}:export:cc"
BUCKET = f"rl:v3:{{t:{TENANT}}}:tenant:{TENANT}:export"


def export(rid: str, user: str, cost: int = 1, tenant: str = TENANT) -> dict:
    return {"requestId": rid, "tenantId": tenant, "principal": {"type": "user", "id": user},
            "routeGroup": "export", "method": "POST", "costHint": cost}


def test_a_decision_record_answers_only_its_own_question(agent_service: Service):
    assert agent_service.redis is not None
    r = redis.Redis.from_url(agent_service.redis.url)
    h = agent_service.headers
    with httpx.Client(base_url=agent_service.base, headers=h, timeout=10) as c:
        first = c.post("/v1/admit", json=export("r-shared-0001", "U-alice")).json()
        assert first["allowed"] and first["policyId"] == "export-tenant"
        for i in (1, 2):  # fill the export gate (3 in flight)
            assert c.post("/v1/admit", json=export(f"r-fill-000{i}", f"U-f{i}")).json()["allowed"]
        assert c.post("/v1/admit", json=export("r-fill-0003", "U-f3")).json()["reason"] == "CONCURRENCY_EXCEEDED"
        tokens, in_flight = r.hget(BUCKET, "tokens"), r.zcard(GATE)
        for body in (export("r-shared-0001", "U-mallory"),  # another principal
                     export("r-shared-0001", "U-alice", cost=2),  # another cost
                     {**export("r-shared-0001", "U-alice"), "principal": {"type": "user", "id": "U-alice",
                                                                         "apiKeyId": "K-other"}}):
            resp = c.post("/v1/admit", json=body)
            assert resp.status_code == 409, resp.text
            assert resp.headers["content-type"].startswith("application/problem+json")
            problem = resp.json()
            assert problem["type"].endswith("/decision-conflict") and problem["decisionId"] == "r-shared-0001"
            assert "allowed" not in problem
        batch = c.post("/v1/admit/batch", json={"requests": [export("r-shared-0001", "U-mallory"),
                                                             export("r-batch-0001", "U-f4")]})
        assert batch.status_code == 200, batch.text
        conflict, other = batch.json()["decisions"]
        assert (conflict["allowed"], conflict["httpStatus"], conflict["reason"]) == (False, 409, "REQUEST_ID_CONFLICT")
        assert conflict["problem"]["type"].endswith("/decision-conflict") and conflict["retryAfterMs"] == -1
        assert other["reason"] == "CONCURRENCY_EXCEEDED"  # decided on its own
        # nothing charged, nobody let past the full gate
        assert r.hget(BUCKET, "tokens") == tokens and r.zcard(GATE) == in_flight == 3
        # the original question still replays its own answer
        again = c.post("/v1/admit", json=export("r-shared-0001", "U-alice"))
        assert again.status_code == 200 and again.json()["allowed"] and r.zcard(GATE) == 3
        for rid, user in (("r-shared-0001", "U-alice"), ("r-fill-0001", "U-f1"), ("r-fill-0002", "U-f2")):
            rel = c.post("/v1/release", json={"requestId": rid, "tenantId": TENANT, "routeGroup": "export",
                                              "principal": {"type": "user", "id": user}})
            assert rel.status_code == 200, rel.text
    assert r.zcard(GATE) == 0


def test_an_id_holding_the_separator_does_not_borrow_another_principals_record(agent_service: Service):
    """The record's question joins the principal id and the API key id with a separator (0x1F): user
    ``P\x1fK`` without a key and user ``P`` with the key ``K\x1f`` once asked the same question, and
    the second, another principal, got the first one's recorded allow for the same requestId, charged
    nothing and passed a full concurrency gate. A principal or API key id is identity text now (no
    control character, kernel.ids): both are refused 422 where the question enters, before anything
    is recorded or charged, so no id can carry the separator."""
    assert agent_service.redis is not None
    tenant = "theta"  # keys of its own
    r = redis.Redis.from_url(agent_service.redis.url)
    gate = f"rl:v3:{{t:{tenant}}}:tenant:{tenant}:export:cc"
    owner = export("r-sep-000001", "U-p\x1fK-x", tenant=tenant)
    borrower = {**export("r-sep-000001", "U-p", tenant=tenant),
                "principal": {"type": "user", "id": "U-p", "apiKeyId": "K-x\x1f"}}
    with httpx.Client(base_url=agent_service.base, headers=agent_service.headers, timeout=10) as c:
        for i in (1, 2):  # two of the export gate's 3 slots held by others
            assert c.post("/v1/admit", json=export(f"r-sep-fill-{i}", f"U-s{i}", tenant=tenant)).json()["allowed"]
        for question in (owner, borrower, owner):
            resp = c.post("/v1/admit", json=question)
            assert resp.status_code == 422, resp.text
            assert resp.headers["content-type"].startswith("application/problem+json")
        assert r.zcard(gate) == 2  # nothing charged for either
        assert len(r.keys(f"rl:v3:{{t:{tenant}}}:d:*")) == 2  # and nothing recorded: the fill requests' records only
        for rid, user in (("r-sep-fill-1", "U-s1"), ("r-sep-fill-2", "U-s2")):
            rel = c.post("/v1/release", json={"requestId": rid, "tenantId": tenant, "routeGroup": "export",
                                              "principal": {"type": "user", "id": user}})
            assert rel.status_code == 200, rel.text
    assert r.zcard(gate) == 0
