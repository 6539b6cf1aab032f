"""Strict and consistent parsing (docs/security.md) on both services as real processes: one set
of identity patterns anchored with ``\\Z`` (a trailing newline is refused on every route,
``/v1/release`` included), no coercion of numbers, no repeated keys, one Authorization header
(the agent's fast path and Litestar agree), ``WWW-Authenticate`` on every 401, and a large
announced body answered 413 at once."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from .conftest import Service

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}


def post(svc: Service, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(svc.base + path, content=content, headers={**svc.headers, **JSON, **headers}, timeout=10)


def test_trailing_newline_is_refused_on_every_agent_route(agent_service: Service):
    admit = agent_service.post_routes["/v1/admit"]
    release = agent_service.post_routes["/v1/release"]
    for field, value in (("requestId", "nl-0000001\n"), ("tenantId", "atlas\n"), ("routeGroup", "read\n")):
        for path, body in (("/v1/admit", {**admit, field: value}),
                           ("/v1/admit/batch", {"requests": [{**admit, field: value}]}),
                           ("/v1/release", {**release, field: value}), ("/v1/renew", {**release, field: value})):
            resp = post(agent_service, path, body)
            assert resp.status_code in (400, 422), (path, field, resp.status_code, resp.text)
    principal = {**admit, "method": "GET\n"}
    assert post(agent_service, "/v1/admit", principal).status_code in (400, 422)


def test_trailing_newline_is_refused_on_every_allocator_route(allocator_service: Service):
    lease = allocator_service.post_routes["/v1/leases"]
    for field, value in (("leaseId", "nl-lease-0001\n"), ("region", "eu\n"), ("pool", "p1\n")):
        assert post(allocator_service, "/v1/leases", {**lease, field: value}).status_code == 400
        assert post(allocator_service, "/v1/leases/batch", {"requests": [{**lease, field: value}]}).status_code == 400
    usage = {"leaseId": "nl-lease-0002\n", "region": "eu", "pool": "p1", "spent": 0}
    assert post(allocator_service, "/v1/leases/nl-lease-0002/usage", usage).status_code == 400


@pytest.mark.parametrize("raw", [b'"1"', b"1e3", b"1E3", b"1.0", b"true", b'"0x10"'])
def test_allocator_refuses_coerced_numbers(allocator_service: Service, raw: bytes):
    body = b'{"leaseId": "coerce-lease-01", "region": "eu", "pool": "p1", "want": ' + raw + b"}"
    resp = post(allocator_service, "/v1/leases", body)
    assert resp.status_code == 400 and "want" in resp.text, resp.text


def test_repeated_keys_are_refused_by_both_services(agent_service: Service, allocator_service: Service):
    admit = json.dumps(agent_service.post_routes["/v1/admit"]).encode()
    # the same requestId twice (fast path) and a tenant smuggled in a second spelling of the key
    for body in (admit[:-1] + b', "requestId": "other-000001"}', admit[:-1] + b', "tenant\\u0049d": "birch"}',
                 admit[:-1] + b', "principal": {"type": "user", "id": "U-1"}}'):
        resp = post(agent_service, "/v1/admit", body)
        assert resp.status_code == 400 and "repeats a key" in resp.json()["detail"], resp.text
    lease = b'{"leaseId": "dup-lease-0001", "region": "eu", "pool": "p1", "want": 1, "want": 7}'
    resp = post(allocator_service, "/v1/leases", lease)
    assert resp.status_code == 400 and "repeats a key" in resp.json()["detail"], resp.text


def test_large_content_length_without_a_body_is_413_at_once(service: Service):
    """The agent's fast path used to wait for the announced body; now the handler answers 413
    before reading (a body deadline would otherwise answer 408 after it)."""
    path = next(iter(service.post_routes))
    with socket.create_connection(("127.0.0.1", service.port), timeout=10) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: " + service.headers["Authorization"].encode() +
                  b"\r\ncontent-length: 50000000\r\n\r\n")
        s.settimeout(10)
        answer = b""
        started = time.monotonic()
        while b"\r\n\r\n" not in answer and time.monotonic() - started < 10:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]


def test_more_than_one_authorization_header_is_refused_by_every_path(service: Service):
    """The fast path read the last header and Litestar the first: with the valid token in one of
    two headers a request got in through one path and not the other. Both refuse it now."""
    good = service.headers["Authorization"]
    for path, body in service.post_routes.items():
        for pair in ((good, "Bearer wrong-token-0000"), ("Bearer wrong-token-0000", good), (good, good)):
            resp = httpx.post(service.base + path, content=json.dumps(body).encode(), timeout=10,
                              headers=[("content-type", "application/json"), ("authorization", pair[0]),
                                       ("authorization", pair[1])])
            assert resp.status_code == 401, (path, pair, resp.status_code, resp.text)
            assert resp.headers["www-authenticate"] == 'Bearer realm="leasehold"'


def test_every_401_carries_www_authenticate(service: Service):
    for path, body in service.post_routes.items():
        for headers in ({}, {"Authorization": "Bearer nope-nope-nope"}, {"Authorization": "Basic eDp5"}):
            resp = httpx.post(service.base + path, json=body, headers=headers, timeout=10)
            assert resp.status_code == 401, resp.text
            assert resp.headers["www-authenticate"] == 'Bearer realm="leasehold"', resp.headers
            assert resp.headers["content-type"].startswith("application/problem+json")
    if service.name == "agent":
        resp = httpx.get(service.base + "/v1/policy", timeout=10)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == 'Bearer realm="leasehold"'


def test_an_empty_body_is_refused_as_one(service: Service):
    """A POST with no body (``Content-Length: 0``, or none) is malformed JSON like any other body
    that is not a document, and its content type is judged as for any body. Litestar does not ask
    for a document when the body is empty: the answer was a validation problem naming the
    handler's own parameter (``"data: 'data'"``), and no Content-Type was not 415."""
    for path in service.post_routes:
        for headers in ({**service.headers, **JSON}, {**service.headers, **JSON, "content-length": "0"}):
            resp = httpx.post(service.base + path, headers=headers, timeout=10)
            assert resp.status_code == 400, (path, resp.status_code, resp.text)
            problem = resp.json()
            assert problem["type"].endswith("/bad-request") and "empty" in problem["detail"], (path, problem)
            assert "'data'" not in resp.text, resp.text
        resp = httpx.post(service.base + path, headers=service.headers, timeout=10)  # no Content-Type
        assert resp.status_code == 415, (path, resp.status_code, resp.text)


def test_a_body_beside_an_upgrade_request_is_refused_not_lost(service: Service):
    """An HTTP parser stops at the end of the head of a request asking for a protocol upgrade: its
    body was never read, the route got an empty body and answered as if none had been sent (the
    agent: "request body is empty" for a valid decision request). Neither service serves an
    upgrade: such a request with a body is a 400 that says so, and the connection is closed."""
    logged = len(service.log())
    for path, body in service.post_routes.items():
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", service.port), timeout=10)
        try:
            s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"authorization: " + service.headers["Authorization"].encode() + b"\r\n"
                      b"connection: Upgrade\r\nupgrade: foo/1\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        finally:
            s.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), (path, answer[:300])
        assert b"application/problem+json" in head.lower(), head
        assert "upgrade" in json.loads(payload)["detail"].lower(), payload
    assert "Traceback" not in service.log()[logged:], service.log()[logged:][-3000:]
