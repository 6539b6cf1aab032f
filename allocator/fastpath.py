"""The happy path of the two batch routes without the framework's per-request machinery.

``POST /v1/leases/batch`` carries the allocator's grant load (agents send up to 512 grants per
request) and ``POST /v1/usage/batch`` its usage reports; Litestar's route pipeline (signature
model, data extraction, response object) cost about a seventh of the allocator's CPU per grant
under ``make bench`` figure 4 (py-spy). This ASGI middleware, installed app-wide, serves exactly
the common case itself:

    POST to one of the two paths, one ``Content-Type`` header that is ``application/json``, a body
    within the size limit that decodes (strictly, no object repeating a key: :mod:`kernel.jsonbody`'s
    rules) into the route's request type, a caller the guard lets in (one Authorization header,
    or authentication disabled), every item naming the caller's own region, no repeated leaseId.

It then runs what the handler runs (``Writer.grant_many`` / ``Writer.report_many``) and answers
200 with the results encoded as the handler encodes them. **Everything else** — another route or
method, a missing or bad credential, another content type, an oversized, malformed or
non-conforming body, an item of another region, a repeated leaseId, an allocator still starting,
a custom guard — is handed to the Litestar handler with the body bytes replayed, so every error
keeps its one code path (and its 4xx problem+json). A differential test
(``tests/integration/allocator/test_fastpath.py``) requires identical answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kernel.asgi import read_body, replay
from kernel.auth import SCOPE_KEY, RegionAuth, authenticate
from kernel.errors import LeaseholdError
from kernel.jsonbody import content_type_of, is_json_media_type, repeats_keys
from kernel.wire import (
    LeaseBatchRequest,
    LeaseBatchResponse,
    LeaseRequest,
    UsageBatchRequest,
    UsageBatchResponse,
    UsageReport,
)

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
LEASES, USAGE = "/v1/leases/batch", "/v1/usage/batch"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_decode_leases = msgspec.json.Decoder(LeaseBatchRequest).decode
_decode_usage = msgspec.json.Decoder(UsageBatchRequest).decode
_encode = msgspec.json.Encoder().encode


def _is_json(raw_headers: list[tuple[bytes, bytes]]) -> bool:
    """One Content-Type header, application/json (kernel.jsonbody's rule)."""
    try:
        return is_json_media_type(content_type_of(raw_headers))
    except LeaseholdError:  # several Content-Type headers: the handler answers 415
        return False


def _lease_keys(r: LeaseRequest) -> int:
    """The keys a decoded lease request shows were in its object: its four required members, and
    each optional one whose value is not the default."""
    return 4 + (r.demand != 0) + (r.window != "current")


def _report_keys(r: UsageReport) -> int:
    return 4 + r.closed_early  # leaseId, region, pool, spent; closedEarly when true


def decode_items(body: bytes, leases: bool) -> list[LeaseRequest] | list[UsageReport] | None:
    """The items of a batch body the fast path serves, or None: it does not decode strictly into
    the route's request type, or an object repeats a key (the handler answers 400,
    kernel.jsonbody). Repeated keys are ruled out by counting (``repeats_keys`` with the keys the
    decoded items show, plus the batch's one member), else by the exact check."""
    items: list[LeaseRequest] | list[UsageReport]
    try:
        if leases:
            items = _decode_leases(body).requests
            shown = 1 + sum(map(_lease_keys, items))
        else:
            items = _decode_usage(body).reports
            shown = 1 + sum(map(_report_keys, items))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if repeats_keys(body, shown) else items


def batch_fast_path(state_of: Callable[[], Any], max_body: int) -> Callable[[ASGIApp], ASGIApp]:
    """Litestar middleware factory; ``state_of()`` returns the app's state (``writer`` once the
    lifespan started it, ``auth_guard``)."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def serve(scope: Scope, receive: Callable[[], Awaitable[Message]],
                        send: Callable[[Message], Awaitable[None]]) -> None:
            path = scope.get("path")
            if scope["type"] != "http" or (path != LEASES and path != USAGE) or scope["method"] != "POST":
                await app(scope, receive, send)
                return
            st = state_of()
            writer = st.get("writer")
            guard = st.get("auth_guard")
            headers = scope.get("headers", [])
            if writer is None or (guard is not None and not isinstance(guard, RegionAuth)) or not _is_json(headers):
                await app(scope, receive, send)
                return
            who = scope.get(SCOPE_KEY)  # authenticated already (the span middleware, with tracing on)
            if guard is not None and who is None:
                try:
                    who = authenticate(guard.table, headers)
                except LeaseholdError:
                    await app(scope, receive, send)  # the guard answers 401 (before reading the body)
                    return
            chunks, body = await read_body(receive, max_body)
            items = None if body is None else decode_items(body, path == LEASES)
            if items is None or (who is not None and any(it.region != who for it in items)) \
                    or len({it.lease_id for it in items}) != len(items):
                await app(scope, replay(chunks, receive), send)  # the handler gives the 4xx problem
                return
            if who is not None:
                scope[SCOPE_KEY] = who
            if path == LEASES:
                payload = _encode(LeaseBatchResponse(results=await writer.grant_many(items)))
            else:
                payload = _encode(UsageBatchResponse(results=await writer.report_many(items)))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_JSON_HEADERS, (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})

        return serve

    return middleware

