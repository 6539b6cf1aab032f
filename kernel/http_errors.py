"""The one HTTP exception mapper of both services.

Every error answer either service gives is built here, from a :class:`kernel.errors.LeaseholdError`:
status and RFC 9457 body from :func:`kernel.errors.to_problem`, headers from
:func:`kernel.errors.problem_headers` (``WWW-Authenticate`` on 401, ``Allow`` on 405,
``Retry-After`` on every retriable error), media type ``application/problem+json``.

* :func:`exception_handlers` — the Litestar ``exception_handlers`` of both apps: our errors as they
  are; Litestar's own client errors (unknown route, wrong method, body too large, malformed body,
  a body or parameter that does not fit the schema) translated to our classes; anything else a
  logged 500 with no detail.
* :func:`problem_answer` — status, headers and encoded body for raw ASGI answers (the agent's
  ``/v1/admit`` fast path and its ``/v1/authz`` route), identical to what the handlers send.

The one per-service choice is ``validation_status``: the status of a body or parameter that
decodes but does not fit the schema — 422 on the agent, 400 on the allocator (their documented
APIs from the start; the problem ``type`` is ``validation-failed`` in both).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from .errors import (
    BadRequest,
    Forbidden,
    LeaseholdError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    problem_headers,
    to_problem,
)
from .jsonbody import note_rejection

PROBLEM_JSON = "application/problem+json"
BODY_REJECTIONS = frozenset({400, 413, 415, 422})  # logged as one short, rate-limited line each
_encode = msgspec.json.Encoder().encode
log = logging.getLogger(__name__)


def _note(exc: LeaseholdError, instance: str | None) -> None:
    if exc.status in BODY_REJECTIONS:
        note_rejection(instance or "", exc.status, exc.detail)


def problem_response(exc: LeaseholdError, instance: str | None = None) -> Response[Any]:
    """The Litestar response for ``exc`` (also for handlers that answer a problem themselves, e.g. ``/readyz``)."""
    _note(exc, instance)
    status, body = to_problem(exc, instance=instance)
    return Response(content=body, status_code=status, media_type=PROBLEM_JSON, headers=problem_headers(exc))


def problem_answer(exc: LeaseholdError, instance: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of the same answer, for raw ASGI senders (lower-case header names)."""
    _note(exc, instance)
    status, body = to_problem(exc, instance=instance)
    headers = {"content-type": PROBLEM_JSON, **{k.lower(): v for k, v in problem_headers(exc).items()}}
    return status, headers, _encode(body)


def validation_errors(exc: HTTPException) -> list[str]:
    """``"key: message"`` per problem Litestar (or :func:`kernel.jsonbody.decode_strict`) reported."""
    items = exc.extra if isinstance(exc.extra, list) else [exc.extra] if exc.extra else []
    return [(f"{e['key']}: " if isinstance(e, dict) and e.get("key") else "")
            + (str(e.get("message", e)) if isinstance(e, dict) else str(e)) for e in items]


def from_http_exception(exc: HTTPException, *, path: str, method: str, validation_status: int) -> LeaseholdError:
    """Litestar's own exception as one of ours (module doc)."""
    status = exc.status_code
    detail = exc.detail or "request rejected"
    if isinstance(exc, ValidationException) or (status == 400 and exc.extra):
        problems = validation_errors(exc) or [detail]
        err: LeaseholdError = ValidationFailed(f"request failed validation: {'; '.join(problems)}"[:1_000],
                                               errors=problems)
        err.status = validation_status
        return err
    if status == 404:
        return NotFound("no such resource")
    if status == 405:
        allow = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow") or ""
        return MethodNotAllowed(f"method {method[:16]} not allowed here", allow=allow)
    if status == 413:
        return PayloadTooLarge("request body too large")
    if status == 401:
        return Unauthorized(detail)
    if status == 403:
        return Forbidden(detail)
    if status == 429:
        return TooManyRequests(detail)
    if 400 <= status < 500:
        err = BadRequest(detail)
        err.status = status
        return err
    if status == 503:
        return Unavailable(detail)
    if "disconnected" in detail:  # Litestar's answer to a client gone mid-body (e.g. a body deadline)
        log.debug("client disconnected on %s", path[:200])
    else:
        log.error("HTTP %s on %s: %s", status, path[:200], detail)
    return LeaseholdError("internal error")


def exception_handlers(*, validation_status: int) -> dict[int | type[Exception], Callable[[Request[Any, Any, Any], Any], Response[Any]]]:
    """The ``exception_handlers`` of a service's Litestar app (module doc)."""

    def on_leasehold(request: Request[Any, Any, Any], exc: LeaseholdError) -> Response[Any]:
        return problem_response(exc, request.url.path)

    def on_http(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
        err = from_http_exception(exc, path=request.url.path, method=request.method,
                                  validation_status=validation_status)
        return problem_response(err, request.url.path)

    def on_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        log.error("unhandled error on %s", request.url.path[:200], exc_info=exc)
        return problem_response(LeaseholdError("internal error"), request.url.path)

    return {LeaseholdError: on_leasehold, HTTPException: on_http, Exception: on_unexpected}


__all__ = ["BODY_REJECTIONS", "PROBLEM_JSON", "exception_handlers", "from_http_exception", "problem_answer",
           "problem_response", "validation_errors"]
