"""The /v1/admit fast path (region_agent.service.fastpath) answers exactly what the Litestar handler
answers: the same inputs, valid and hostile, sent to an agent with and without it (each on its
own Redis, same policy and pepper) give the same status, content type and body."""

from __future__ import annotations

import hashlib
import json

import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer
from region_agent.service import fastpath
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings

GW_TOKEN = "gw-token-for-the-fast-path-test"
GW_ENTRY = "gw:" + hashlib.sha256(GW_TOKEN.encode()).hexdigest()

CASES: list[tuple[str, dict, bytes | dict]] = [
    ("allowed", {}, admit_body("fp-ok-000001")),
    ("anonymous", {}, admit_body("fp-anon-0001", tenant=None, ptype="anonymous", pid="10.1.2.3", route="login",
                                 api_key=None)),
    # an idempotent rule's decision id asked again by someone else: the same 409 on both paths
    ("export", {}, admit_body("fp-export-001", route="export")),
    ("export id reused by another user", {}, admit_body("fp-export-001", route="export", pid="U-2")),
    ("bad tenant id", {}, admit_body("fp-bad-tenant", tenant="Not_A_Tenant")),
    ("no tenant for a user", {}, admit_body("fp-no-tenant", tenant=None)),
    ("bad request id", {}, admit_body("x")),
    ("wrong type", {}, {**admit_body("fp-wrong-type"), "costHint": "many"}),
    ("missing field", {}, {"requestId": "fp-missing-1", "routeGroup": "read"}),
    ("unknown principal type", {}, admit_body("fp-unknown-pt", ptype="robot")),
    ("malformed json", {}, b'{"requestId": "fp-malformed", '),
    ("not an object", {}, b"[1, 2, 3]"),
    ("empty body", {}, b""),
    ("text content type", {"content-type": "text/plain"}, b'{"requestId": "fp-text-0001"}'),
    ("oversized", {}, b'{"requestId": "' + b"a" * 70_000 + b'"}'),
    ("no credential", {"authorization": ""}, admit_body("fp-no-cred-01")),
    ("wrong credential", {"authorization": "Bearer nope"}, admit_body("fp-bad-cred-1")),
]


def _batch(*items) -> dict:
    return {"requests": list(items)}


BATCH_CASES: list[tuple[str, dict, bytes | dict]] = [
    ("batch allowed and anonymous", {}, _batch(admit_body("fb-ok-000001"), admit_body("fb-ok-000002", pid="U-2"),
                                               admit_body("fb-anon-0001", tenant=None, ptype="anonymous",
                                                          pid="10.1.2.3", route="login", api_key=None))),
    ("batch with every optional field", {}, _batch({**admit_body("fb-opt-000001"), "method": "POST", "costHint": 2,
                                                    "policyEpoch": 3})),
    ("batch default values spelled out", {}, _batch({**admit_body("fb-dflt-00001"), "method": "GET",
                                                     "costHint": 1, "authFailed": False})),
    ("empty batch", {}, {"requests": []}),
    ("batch item with no tenant for a user", {}, _batch(admit_body("fb-no-tenant1", tenant=None))),
    ("batch item with a bad request id", {}, _batch(admit_body("fb-good-00001"), admit_body("x"))),
    ("batch with a repeated key", {}, b'{"requests":[{"requestId":"fb-rep-000001","requestId":"fb-rep-000002",'
                                      b'"principal":{"type":"user","id":"U-1"},"routeGroup":"read","tenantId":"atlas"}]}'),
    ("batch with a repeated nested key", {}, b'{"requests":[{"requestId":"fb-rep-000003","principal":{"type":"user",'
                                             b'"id":"U-1","id":"U-2"},"routeGroup":"read","tenantId":"atlas"}]}'),
    ("batch repeated key hidden by a default", {}, b'{"requests":[{"requestId":"fb-rep-000004","principal":{"type":'
                                                   b'"user","id":"U-1"},"routeGroup":"read","tenantId":"atlas",'
                                                   b'"costHint":3,"costHint":1}]}'),
    ("batch with spaces and escapes", {}, b'{ "requests" : [ {"requestId" : "fb-sp-0000001", "principal": {"type":'
                                          b'"user","id":"U-\\u0031"},"routeGroup":"read","tenantId":"atlas"} ] }'),
    ("batch colon-leading value", {}, _batch(admit_body("fb-colon-0001", pid=":U-1"))),
    ("batch malformed", {}, b'{"requests": [{"requestId": "fb-malformed"'),
    ("batch not a list", {}, b'{"requests": {}}'),
    ("batch text content type", {"content-type": "text/plain"}, _batch(admit_body("fb-text-00001"))),
    ("batch no credential", {"authorization": ""}, _batch(admit_body("fb-no-cred-01"))),
]


async def _answers(tmp_path, policy_file, name: str, fast: bool, path: str = "/v1/admit",
                   cases: list | None = None) -> list[tuple[int, str, bytes]]:
    redis = RedisServer(tmp_path / name).start()
    try:
        settings = make_settings(redis.url, policy_file, auth_disabled=False, gateway_tokens=[GW_ENTRY])
        app = create_app(settings, pepper=PEPPER, fast_path=fast)
        out = []
        async with AsyncTestClient(app=app) as c:
            for _, headers, body in CASES if cases is None else cases:
                h = {"authorization": f"Bearer {GW_TOKEN}", "content-type": "application/json", **headers}
                h = {k: v for k, v in h.items() if v}
                content = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
                r = await c.post(path, content=content, headers=h)
                out.append((r.status_code, r.headers.get("content-type", ""), r.content))
        return out
    finally:
        redis.stop()


async def test_fast_path_answers_like_the_handler(tmp_path, policy_file, monkeypatch):
    served: list[str] = []
    real = fastpath._answer

    async def counting(st, req, send, *rest):
        served.append(req.request_id)
        await real(st, req, send, *rest)

    monkeypatch.setattr(fastpath, "_answer", counting)
    fast = await _answers(tmp_path, policy_file, "fast", True)
    # the fast path served what decodes; everything else went to the handler
    assert served == ["fp-ok-000001", "fp-anon-0001", "fp-export-001", "fp-export-001", "fp-no-tenant"], served
    monkeypatch.setattr(fastpath, "_answer", real)
    slow = await _answers(tmp_path, policy_file, "slow", False)
    for (name, _, _), f, s in zip(CASES, fast, slow, strict=True):
        assert f == s, f"{name}: fast path {f!r} vs handler {s!r}"
    statuses = {name: f[0] for (name, _, _), f in zip(CASES, fast, strict=True)}
    assert statuses["allowed"] == 200 and statuses["anonymous"] == 200 and statuses["export"] == 200
    assert statuses["export id reused by another user"] == 409
    assert all(400 <= statuses[n] < 500 for n in statuses if n not in ("allowed", "anonymous", "export")), statuses


@pytest.mark.parametrize("fast", [True, False])
async def test_the_decision_body_is_the_handlers(tmp_path, policy_file, fast):
    """A 200 decision names the request and the policy version either way."""
    ans = await _answers(tmp_path, policy_file, f"one-{fast}", fast)
    status, ctype, body = ans[0]
    assert status == 200 and ctype.startswith("application/json")
    assert b'"decisionId":"fp-ok-000001"' in body and b'"allowed":true' in body


async def test_batch_fast_path_answers_like_the_handler(tmp_path, policy_file, monkeypatch):
    """The batch route through the fast path and through Litestar: same status, type and body for
    valid batches, repeated keys (found by the count or by the exact check) and refused bodies."""
    served: list[int] = []
    real = fastpath._answer_batch

    async def counting(st, batch, send, *rest):
        served.append(len(batch.requests))
        await real(st, batch, send, *rest)

    monkeypatch.setattr(fastpath, "_answer_batch", counting)
    fast = await _answers(tmp_path, policy_file, "bfast", True, "/v1/admit/batch", BATCH_CASES)
    assert served == [3, 1, 1, 0, 1, 1, 1], served  # what decodes, has no repeated key and is authorised
    monkeypatch.setattr(fastpath, "_answer_batch", real)
    slow = await _answers(tmp_path, policy_file, "bslow", False, "/v1/admit/batch", BATCH_CASES)
    for (name, _, _), f, s in zip(BATCH_CASES, fast, slow, strict=True):
        assert f == s, f"{name}: fast path {f!r} vs handler {s!r}"
    statuses = {name: f[0] for (name, _, _), f in zip(BATCH_CASES, fast, strict=True)}
    assert statuses["batch allowed and anonymous"] == 200 and statuses["empty batch"] == 200
    assert statuses["batch with a repeated key"] == 400 and statuses["batch with a repeated nested key"] == 400
    assert statuses["batch repeated key hidden by a default"] == 400
    assert statuses["batch with spaces and escapes"] == 200 and statuses["batch colon-leading value"] == 200
