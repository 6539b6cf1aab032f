"""The happy path of ``POST /v1/admit`` and ``POST /v1/admit/batch`` without the framework's
per-request machinery.

A gateway calls ``/v1/admit`` once per request it serves, so the agent's CPU per call is the
product. Litestar's route pipeline (signature model, data extraction, response object, header
handling) costs about as much as the decision itself (``make bench`` figure 2 profile). This
ASGI middleware, installed app-wide, serves exactly the common case itself:

    POST /v1/admit, one ``Content-Type: application/json``, a body within the size limit that
    decodes (strictly, no repeated keys: :mod:`kernel.jsonbody`) into :class:`AdmitRequest`, and
    a caller the guard would let in.

(A batch is served the same way: ``POST /v1/admit/batch`` with a body that decodes into
:class:`AdmitBatch`, through the batch handler's own ``decide_batch``.) A repeated key is looked
for by counting (``kernel.jsonbody.repeats_keys`` with the keys the decoded value shows), which
is exact and falls back to the full check whenever the count cannot prove there is none.

It then asks the agent's one admission (:class:`region_agent.decision.admission.Admission`, as the
handler does) and answers 200 with the decision encoded exactly as Litestar would (msgspec JSON
of the same Struct); a request-id conflict is the handler's 409. A question the admission
cannot answer (:class:`LeaseholdError`, e.g. an invalid tenant id) becomes the same
problem+json answer as the app's exception handler gives. **Everything else** — another route
or method, a missing or bad credential, another content type, an oversized, malformed or
non-conforming body, an agent still starting — is handed to the normal Litestar handler with the
body bytes replayed, so every error keeps its one code path (and its 4xx problem+json). A body
announced larger than the limit is handed over before anything is read (the handler answers
413 at once instead of waiting for bytes that may never come).

The same requests are also served one step earlier, by the HTTP protocol itself
(:class:`DirectAdmit`, ``kernel.httpserver``'s direct routes): the head is judged as above
(``admits``: agent started, one JSON content type, one announced length within the limit, no
transfer coding, a caller the guard would let in), the body decoded the same way, the same
admission asked and the same answer built (:func:`admit_answer`), written without any ASGI step.
A request the protocol does not take (pipelined behind another, ``Expect: 100-continue``, ...)
reaches this middleware as before, and anything the fast path would hand over goes to the
Litestar handler either way.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

from kernel.asgi import read_body, replay
from kernel.auth import SCOPE_KEY
from kernel.errors import LeaseholdError
from kernel.http_errors import problem_answer
from kernel.jsonbody import is_json_media_type, repeats_keys

from ..decision.admission import http_conflict, is_conflict
from ..models import MAX_BATCH_BODY_BYTES, AdmitBatch, AdmitRequest, AdmitText, admit_of_text, keys_shown

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
PATH = "/v1/admit"
BATCH_PATH = "/v1/admit/batch"
_JSON_HEADERS = [(b"content-type", b"application/json")]
log = logging.getLogger(__name__)
_decode_batch = msgspec.json.Decoder(AdmitBatch).decode
_encode = msgspec.json.Encoder().encode


_decode_text = msgspec.json.Decoder(AdmitText).decode


def admit_fast_path(state_of: Callable[[], Any], max_body: int,
                    decide_batch: Callable[..., Awaitable[Any]] | None = None,
                    batch_max_body: int = MAX_BATCH_BODY_BYTES) -> Callable[[ASGIApp], ASGIApp]:
    """Litestar middleware factory; ``state_of()`` returns the agent's ``AgentState`` (its
    ``admission`` answers); ``decide_batch(state, requests, carrier)`` the batch handler's own body
    (``region_agent.service.app.decide_batch``): with it, ``POST /v1/admit/batch`` is served the same way.
    The request's headers go to the admission as the gateway's trace context."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def serve(scope: dict, receive: Callable[[], Awaitable[dict]],
                        send: Callable[[dict], Awaitable[None]]) -> None:
            if scope["type"] != "http" or scope["method"] != "POST":
                await app(scope, receive, send)
                return
            path = scope["path"]
            if path == PATH:
                limit, batch = max_body, False
            elif path == BATCH_PATH and decide_batch is not None:
                limit, batch = batch_max_body, True
            else:
                await app(scope, receive, send)
                return
            st = state_of()
            raw_headers = scope.get("headers", ())
            if st.engine is None or _json_within(raw_headers) > limit:
                # another content type (415), or a body announced too large: the handler answers
                # at once (413 before reading anything)
                await app(scope, receive, send)
                return
            if st.auth is not None:
                try:
                    who = st.auth.check(path, raw_headers)  # the guard's own check, same header list
                except LeaseholdError:
                    await app(scope, receive, send)  # the guard answers 401 (before reading the body)
                    return
                if who is not None:
                    scope[SCOPE_KEY] = who
            chunks, body = await read_body(receive, limit)
            req = None if body is None else decode_admit(body, batch)
            if req is None:
                await app(scope, replay(chunks, receive), send)
                return
            try:
                if batch:
                    await _answer_batch(st, req, send, decide_batch, raw_headers)  # type: ignore[arg-type]  # decide_batch is set whenever batch is true
                else:
                    await _answer(st, req, send, raw_headers)
            except Exception:  # a bug: the app's exception handler's answer (nothing was sent yet)
                log.exception("unhandled error on %s", path)
                await _send_problem(send, LeaseholdError("internal error"), path)

        return serve

    return middleware


def install(app: Any, middleware: Callable[[ASGIApp], ASGIApp]) -> None:
    """Put the fast path in front of the Litestar app's router. ``Litestar.__call__`` sets
    ``scope["app"]`` and ``scope["state"]`` and then calls ``app.asgi_handler`` (the router behind
    the app's exception handling): wrapping that attribute lets a served request skip the route
    lookup and the route's middleware stack (about 5 % of a request's CPU as an app-level
    middleware), while everything handed over still meets the full app. The one place that knows
    this part of Litestar; ``tests/integration/region_agent/test_fastpath.py`` fails when it changes."""
    if not callable(getattr(app, "asgi_handler", None)):
        raise RuntimeError("Litestar no longer has asgi_handler: region_agent.service.fastpath.install needs a new seam")
    app.asgi_handler = middleware(app.asgi_handler)


def decode_admit(body: bytes, batch: bool) -> Any:
    """The :class:`AdmitRequest` (or :class:`AdmitBatch`) the fast path serves, or None: the body
    does not decode strictly into it, or repeats a key (the handler answers 400, kernel.jsonbody).

    A single request is decoded as :class:`AdmitText` and its four patterned fields are checked
    by their own patterns (``kernel.ids``), the route group, tenant and method only when they are
    not among the values a pattern already took (:func:`~region_agent.models.admit_of_text`): the same bodies are served, each as the same
    :class:`AdmitRequest`; a field its pattern refuses hands the body over, whose handler's strict
    decode answers 400 as before."""
    if batch:
        try:
            batch_req = _decode_batch(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return None if repeats_keys(body, 1 + sum(map(keys_shown, batch_req.requests))) else batch_req
    try:
        t = _decode_text(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    req = admit_of_text(t)
    if req is None:
        return None  # a pattern refuses it: the handler's strict decode answers
    return None if repeats_keys(body, keys_shown(req)) else req


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers (no content-length), body


async def admit_answer(st: Any, req: AdmitRequest, raw_headers: Any = ()) -> Answer:
    """``POST /v1/admit``'s answer, as the handler gives it: 200 and the decision, the 409 problem of
    a request-id conflict, or the problem of a question the admission refuses."""
    try:
        decision = await st.admission.decide_one(req, door="http", carrier=raw_headers, decoded=True)
    except LeaseholdError as e:
        return _problem(e, PATH)
    if is_conflict(decision):
        return _problem(http_conflict(decision), PATH)  # as the handler: 409
    return 200, _JSON_HEADERS, _encode(decision)


async def admit_batch_answer(st: Any, batch: AdmitBatch, decide_batch: Callable[..., Awaitable[Any]],
                             raw_headers: Any = ()) -> Answer:
    """``POST /v1/admit/batch``'s answer, as the handler gives it."""
    try:
        decisions = await decide_batch(st, batch.requests, raw_headers)
    except LeaseholdError as e:
        return _problem(e, BATCH_PATH)
    return 200, _JSON_HEADERS, _encode(decisions)


def _problem(e: LeaseholdError, path: str) -> Answer:
    """The app's exception handler's answer (kernel.http_errors)."""
    status, named, payload = problem_answer(e, path)
    return status, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in named.items()], payload


async def _answer_batch(st: Any, batch: AdmitBatch, send: Callable[[dict], Awaitable[None]],
                        decide_batch: Callable[..., Awaitable[Any]], raw_headers: Any = ()) -> None:
    status, headers, payload = await admit_batch_answer(st, batch, decide_batch, raw_headers)
    await _send(send, status, payload, headers)


async def _answer(st: Any, req: AdmitRequest, send: Callable[[dict], Awaitable[None]], raw_headers: Any = ()) -> None:
    status, headers, payload = await admit_answer(st, req, raw_headers)
    await _send(send, status, payload, headers)


async def _send_problem(send: Callable[[dict], Awaitable[None]], e: LeaseholdError, path: str) -> None:
    status, headers, payload = _problem(e, path)
    await _send(send, status, payload, headers)


class DirectAdmit:
    """``POST /v1/admit`` (or, with ``decide_batch``, ``/v1/admit/batch``) as a direct route of the
    HTTP protocol (``kernel.httpserver.DirectRoute``; the module's docstring)."""

    def __init__(self, state_of: Callable[[], Any], max_body: int, path: str,
                 decide_batch: Callable[..., Awaitable[Any]] | None = None) -> None:
        self._state_of = state_of
        self._max = max_body
        self._path = path
        self._decide_batch = decide_batch

    def admits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        st = self._state_of()
        if st.engine is None:
            return False
        announced = _announced_json(headers)
        if announced < 0 or announced > self._max:
            return False
        if st.auth is not None:
            try:
                st.auth.check(self._path, headers)  # the guard's own check, before the body is read
            except LeaseholdError:
                return False  # the guard answers 401
        return True

    def answer(self, headers: list[tuple[bytes, bytes]], body: bytes) -> Awaitable[Answer] | None:
        batch = self._decide_batch is not None
        req = decode_admit(body, batch)
        if req is None:
            return None
        return self._answered(req, headers)

    async def _answered(self, req: Any, headers: list[tuple[bytes, bytes]]) -> Answer:
        st = self._state_of()
        try:
            if self._decide_batch is not None:
                return await admit_batch_answer(st, req, self._decide_batch, headers)
            return await admit_answer(st, req, headers)
        except Exception:  # a bug: the app's exception handler's answer
            log.exception("unhandled error on %s", self._path)
            return _problem(LeaseholdError("internal error"), self._path)


def direct_routes(app: Any) -> Mapping[bytes, DirectAdmit] | None:
    """The agent's direct routes for ``kernel.httpserver.serve(direct=...)``: those ``create_app``
    put in the app's state (None when it was built without the fast path). ``app`` is what uvicorn
    loaded: the Litestar app, or a uvicorn middleware around it."""
    for _ in range(4):
        state = getattr(app, "state", None)
        routes = getattr(state, "direct_routes", None) if state is not None else None
        if routes is not None:
            return routes
        app = getattr(app, "app", None)
        if app is None:
            break
    return None


async def _send(send: Callable[[dict], Awaitable[None]], status: int, payload: bytes, headers: list) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _json_within(raw_headers: Any) -> int:
    """One pass over the headers: the Content-Length the client announced (0 when absent or
    unreadable: the handler judges), or ``_NOT_JSON`` unless there is exactly one Content-Type
    and it is application/json (kernel.jsonbody's rule)."""
    ctype: bytes | None = None
    announced = 0
    seen = False
    for name, value in raw_headers:
        name = name.lower()
        if name == b"content-type":
            if ctype is not None:
                return _NOT_JSON  # several: the handler answers 415
            ctype = value
        elif name == b"content-length" and not seen:  # the first one, as the handler reads it
            seen = True
            try:
                announced = int(value)
            except ValueError:
                announced = 0
    if ctype is None or (ctype != b"application/json" and not is_json_media_type(ctype.decode("latin-1"))):
        return _NOT_JSON
    return announced


_NOT_JSON = 1 << 62  # above every limit: hand the request over


def _announced_json(raw_headers: list[tuple[bytes, bytes]]) -> int:
    """The announced length of a body the protocol may read for a direct route, or -1: exactly one
    Content-Type, application/json; exactly one Content-Length, a plain decimal; no
    Transfer-Encoding. Anything else is the application's to judge."""
    ctype: bytes | None = None
    length: bytes | None = None
    for name, value in raw_headers:  # uvicorn lower-cases the names
        if name == b"content-type":
            if ctype is not None:
                return -1
            ctype = value
        elif name == b"content-length":
            if length is not None:
                return -1
            length = value
        elif name == b"transfer-encoding":
            return -1
    if ctype is None or length is None or not length.isdigit() or len(length) > 9:
        return -1
    if ctype != b"application/json" and not is_json_media_type(ctype.decode("latin-1")):
        return -1
    return int(length)
