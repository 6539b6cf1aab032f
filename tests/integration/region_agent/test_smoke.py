from __future__ import annotations

from tests.support.agent import admit_body


async def test_admit_allowed(agent):
    r = await agent.post("/v1/admit", json=admit_body("req-00000001"))
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["allowed"] is True, d
    assert d["policyId"] == "read-user-v3"
    assert d["policyVersion"] == 42
    assert d["remaining"] == 19
