"""The hostile-body corpus (docs/security.md): against EVERY POST route of BOTH services, as real
processes with authentication on, a corpus of malformed bodies — deep nesting, huge numbers,
repeated keys, every field with a value of the wrong type, NUL, bad UTF-8, huge strings, empty
and non-object documents, truncation, trailing garbage — and of wrong content types. Every
answer must be a 4xx ``application/problem+json``; no 5xx, no traceback in the logs, and the
services log the refusals as short lines."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from .conftest import Service

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}


def structural(valid: bytes) -> Iterator[tuple[str, bytes]]:
    """Bodies that are not a well-formed instance of any route's schema."""
    yield "nested arrays x2000", b"[" * 2000 + b"]" * 2000
    yield "nested arrays x100000 unclosed", b"[" * 100_000
    yield "nested objects x5000", b'{"a":' * 5000 + b"1" + b"}" * 5000
    yield "nested in a field", valid[:-1] + b', "deep": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    yield "nested as the first field's value", b'{"requestId": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    yield "empty", b""
    yield "whitespace", b" \r\n\t "
    for doc in (b"null", b"[]", b'"x"', b"1", b"true", b"-0", b"1e400", b"[" + valid + b"]"):
        yield f"top level {doc[:20]!r}", doc
    yield "truncated", valid[: len(valid) // 2]
    yield "trailing garbage", valid + b"x"
    yield "two documents", valid + valid
    yield "BOM", b"\xef\xbb\xbf" + valid
    yield "NUL byte", valid[:-1] + b"\x00}"
    yield "NUL before", b"\x00" + valid
    yield "bad UTF-8 in a string", valid[:2] + b"\xff\xfe" + valid[2:]
    yield "overlong UTF-8", valid.replace(b'"', b'"\xc0\xaf', 1)
    yield "NaN", valid[:-1] + b', "n": NaN}'
    yield "single quotes", valid.replace(b'"', b"'")
    yield "comment", b"/* c */" + valid
    yield "huge integer", valid[:-1] + b', "x": ' + b"9" * 5000 + b"}"
    yield "huge string (above every body limit)", b'{"requestId": "' + b"a" * (2 * 1024 * 1024) + b'"}'
    yield "15 KiB string", valid[:-1] + b', "pad": "' + b"b" * 15_000 + b'"}'
    first_key = valid[1:].split(b":", 1)[0]
    yield "repeated key", b"{" + first_key + b': "dup", ' + valid[1:]
    yield "repeated key, escaped spelling", b"{" + first_key[:2] + b"\\u00" + \
        f"{first_key[2]:02x}".encode() + first_key[3:] + b': "dup", ' + valid[1:]
    yield "repeated key, space before colon", valid[:-1] + b", " + first_key + b' : "dup"}'


WRONG_FOR = {
    str: [b"1", b"1.5", b"[]", b"{}", b"true", b"null"],
    int: [b'"1"', b"1.5", b"1e3", b"1E3", b"[]", b"{}", b"true", b'"x"', b"1e400", b"-1e400"],
    dict: [b'"x"', b"1", b"[]", b"true"],
    list: [b'"x"', b"1", b"{}", b"true", b"[1]"],
}


def wrong_types(body: dict, optional: set[str]) -> Iterator[tuple[str, bytes]]:
    """Every field (nested ones too) replaced by values of another JSON type."""
    def walk(obj: dict, path: list[str]) -> Iterator[tuple[list[str], object]]:
        for k, v in obj.items():
            yield [*path, k], v
            if isinstance(v, dict):
                yield from walk(v, [*path, k])
            if isinstance(v, list) and v and isinstance(v[0], dict):
                yield from walk(v[0], [*path, k, "0"])

    marker = "\u2603MARK\u2603"
    for path, value in walk(body, []):
        for bad in WRONG_FOR[type(value) if type(value) in WRONG_FOR else str]:
            if bad == b"null" and path[-1] in optional:
                continue  # null is a valid value of an optional field
            doc = json.loads(json.dumps(body))
            target = doc
            for p in path[:-1]:
                target = target[int(p)] if isinstance(target, list) else target[p]
            target[path[-1]] = marker
            raw = json.dumps(doc).encode().replace(json.dumps(marker).encode(), bad)
            yield f"{'.'.join(path)} = {bad.decode()}", raw


OPTIONAL = {"tenantId", "apiKeyId", "policyEpoch", "clientIp"}


def corpus(valid_body: dict) -> list[tuple[str, bytes]]:
    valid = json.dumps(valid_body).encode()
    return [*structural(valid), *wrong_types(valid_body, OPTIONAL)]


def post(client: httpx.Client, svc: Service, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return client.post(svc.base + path, content=body, headers={**svc.headers, **headers})


def assert_problem(resp: httpx.Response, what: str) -> None:
    assert 400 <= resp.status_code < 500, (what, resp.status_code, resp.text[:300])
    assert resp.headers["content-type"].startswith("application/problem+json"), (what, resp.headers)
    problem = resp.json()
    assert problem["status"] == resp.status_code and problem["type"].startswith("https://leasehold.dev/problems/")


def test_hostile_bodies_on_every_post_route(service: Service):
    statuses: Counter = Counter()
    with httpx.Client(timeout=30) as client:
        for path, valid_body in service.post_routes.items():
            cases = corpus(valid_body)
            assert len(cases) >= 60, len(cases)
            for what, body in cases:
                resp = post(client, service, path, body, JSON)
                assert_problem(resp, f"{path}: {what}")
                statuses[resp.status_code] += 1
            # the valid body itself is not refused for its shape (a 404/409 about state is fine)
            ok = post(client, service, path, json.dumps(valid_body).encode(), JSON)
            assert ok.status_code in (200, 404, 409), (path, ok.text)
    assert statuses[400] > 0 and statuses[413] > 0 and (statuses[422] + statuses[400]) > 100, statuses
    log = service.log()
    assert "Traceback" not in log and " 500 " not in log and "ERROR" not in log, log[-3000:]
    assert "refused 400" in log  # the short line, not a traceback
    assert max(len(line) for line in log.splitlines()) < 400


CONTENT_TYPES = [None, "text/plain", "application/jsonx", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1", "application/*",
                 "json", "application/problem+json"]


def test_non_json_content_types_are_415(service: Service):
    with httpx.Client(timeout=10) as client:
        for path, valid_body in service.post_routes.items():
            body = json.dumps(valid_body).encode()
            for ctype in CONTENT_TYPES:
                headers = {} if ctype is None else {"content-type": ctype}
                resp = post(client, service, path, body, headers)
                assert resp.status_code == 415, (path, ctype, resp.status_code, resp.text)
                assert_problem(resp, f"{path} {ctype}")
            twice = client.post(service.base + path, content=body,
                                headers=[("authorization", service.headers["Authorization"]),
                                         ("content-type", "application/json"), ("content-type", "text/plain")])
            assert twice.status_code == 415, twice.text
            charset = post(client, service, path, body, {"content-type": "application/json; charset=UTF-8"})
            assert charset.status_code in (200, 404, 409), charset.text


def test_forward_auth_ignores_hostile_bodies(agent_service: Service):
    """/v1/authz (Envoy/Traefik/nginx forward auth) takes its question from headers and any method:
    a hostile body changes nothing, never a 5xx."""
    question = {"x-route-group": "read", "x-tenant-id": "atlas", "x-user-id": "U-authz"}
    valid = json.dumps(agent_service.post_routes["/v1/admit"]).encode()
    with httpx.Client(timeout=30) as client:
        for what, body in structural(valid):
            resp = post(client, agent_service, "/v1/authz", body, {**JSON, **question})
            assert resp.status_code in (200, 429), (what, resp.status_code, resp.text[:200])
            bare = post(client, agent_service, "/v1/authz", body, JSON)  # no question headers
            assert_problem(bare, what)
