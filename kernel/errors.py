"""One small error hierarchy for both services.

Every error carries ``retriable`` (tenacity's retry predicates read it), an HTTP
``status`` and a stable ``code`` (the problem ``type`` suffix). Adapters translate driver
errors (redis, grpc/aetcd, httpx) into these at the boundary; :func:`to_problem` is the
only place an error becomes an HTTP response body.
"""

from __future__ import annotations

from typing import Any

PROBLEM_BASE = "https://leasehold.dev/problems/"


class LeaseholdError(Exception):
    """Base class. Subclasses set the class attributes; instances may add ``extra``."""

    status: int = 500
    code: str = "internal"
    title: str = "Internal error"
    retriable: bool = False

    def __init__(self, detail: str = "", *, extra: dict[str, Any] | None = None, retriable: bool | None = None):
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.extra = dict(extra or {})
        if retriable is not None:
            self.retriable = retriable


# --- caller errors (4xx), never retriable -------------------------------------------------
class BadRequest(LeaseholdError):
    status, code, title = 400, "bad-request", "Malformed request"


class ValidationFailed(LeaseholdError):
    status, code, title = 422, "validation-failed", "Request failed validation"

    def __init__(self, detail: str = "", *, errors: list[str] | None = None, **kw: Any):
        super().__init__(detail, **kw)
        self.errors = list(errors or [])
        if self.errors:
            self.extra.setdefault("errors", self.errors)


class Unauthorized(LeaseholdError):
    status, code, title = 401, "unauthorized", "Missing or invalid credentials"


class Forbidden(LeaseholdError):
    status, code, title = 403, "forbidden", "Not permitted"


class NotFound(LeaseholdError):
    status, code, title = 404, "not-found", "No such resource"


class MethodNotAllowed(LeaseholdError):
    """The route exists but not for this method; ``allow`` lists the methods it has (the
    answer's ``Allow`` header, RFC 9110 section 15.5.6)."""

    status, code, title = 405, "method-not-allowed", "Method not allowed"

    def __init__(self, detail: str = "", *, allow: str = "", **kw: Any):
        super().__init__(detail, **kw)
        self.allow = allow


class Conflict(LeaseholdError):
    status, code, title = 409, "conflict", "Conflicts with the current state"


class DecisionConflict(Conflict):
    """A decision id (``requestId``) already has a decision record for another question (tenant,
    principal, route group or cost differ): the stored answer is not given to this caller, and
    nothing is charged. Use a fresh request id."""

    code, title = "decision-conflict", "Request id already used for another question"


class PayloadTooLarge(LeaseholdError):
    status, code, title = 413, "payload-too-large", "Request body too large"


class UnsupportedMediaType(LeaseholdError):
    status, code, title = 415, "unsupported-media-type", "Request body must be application/json"


class TooManyRequests(LeaseholdError):
    """The caller sent too many requests to this service itself (not a rate-limit *decision*:
    those are 200 answers of ``/v1/admit``). Retriable after ``extra["retryAfterMs"]`` (default 1 s)."""

    status, code, title, retriable = 429, "too-many-requests", "Too many requests", True


# --- policy errors: the configuration is wrong; alert, do not retry -----------------------
class PolicyError(LeaseholdError):
    status, code, title = 422, "policy-invalid", "Policy bundle is invalid"

    def __init__(self, detail: str = "", *, errors: list[str] | None = None, **kw: Any):
        super().__init__(detail, **kw)
        self.errors = list(errors or [])
        if self.errors:
            self.extra.setdefault("errors", self.errors)

    @property
    def further(self) -> list[str]:
        """The problems ``detail`` does not state already: what a report lists below it (a one-problem
        bundle's detail names its problem, so it is said once)."""
        return [p for p in self.errors if p not in self.detail]


class StaleVersion(Conflict):
    code, title = "stale-version", "Bundle version is not higher than the current one"


class ScriptRejected(PolicyError):
    """A Redis script answered with an error reply: it validated its arguments and changed
    nothing. A policy fault, never retried."""

    status, code, title = 500, "script-rejected", "Limiter script rejected its arguments"


# --- dependency errors (retriable 503) -----------------------------------------------------
class Unavailable(LeaseholdError):
    status, code, title, retriable = 503, "unavailable", "Dependency unavailable", True


class StoreUnavailable(Unavailable):
    """The store could not be reached; nothing was sent, so nothing ran."""

    code, title = "store-unavailable", "Store unreachable"


class NothingRan(StoreUnavailable):
    """The store was answering, the script call did not run, and what failed was one connection
    at a point where the agent knows that: before any byte of the call was written (a new
    connection lost or timed out while it said its handshake), or after Redis answered
    ``NOSCRIPT`` (the script was not loaded, so it did not run) and before the call was sent
    again (the ``SCRIPT LOAD``'s connection lost or timed out). Not ambiguous: sending the call
    once more cannot debit twice, with or without a decision record, so the decision engine sends
    it again within its budget. Like any store failure it counts against the node's breaker, and
    a decision that still has no answer degrades as the store unreachable."""

    code, title = "nothing-ran", "The store call did not run"


class AmbiguousOutcome(Unavailable):
    """The command was sent but no reply came back: it may or may not have run."""

    code, title = "ambiguous-outcome", "Outcome unknown after send"


class DeadlineExceeded(Unavailable):
    code, title = "deadline-exceeded", "Deadline exceeded"


class Overloaded(Unavailable):
    """This process is saturated (its queue or its event loop), the dependency is fine: shed the
    work with a retriable answer; never treat it as the dependency failing."""

    code, title = "overloaded", "Overloaded"


class NotLeader(Unavailable):
    """This allocator replica is not the leader; ``extra`` names the leader if known."""

    code, title = "not-leader", "Not the allocator leader"


class Fenced(Unavailable):
    """A leader write failed its epoch compare: this replica was deposed."""

    code, title = "fenced", "Leadership lost (epoch fenced)"


class StaleEpoch(LeaseholdError):
    """A grant carries an epoch older than one already seen; it is refused."""

    status, code, title = 409, "stale-epoch", "Grant from a deposed allocator epoch"


WWW_AUTHENTICATE = 'Bearer realm="leasehold"'


def problem_headers(exc: LeaseholdError) -> dict[str, str]:
    """Response headers an error's answer carries, the same in both services (RFC 9110):
    ``WWW-Authenticate`` on every 401, ``Allow`` on a 405, and ``Retry-After`` (whole seconds,
    at least 1: ``extra["retryAfterMs"]`` rounded up, else 1) on every retriable error."""
    headers: dict[str, str] = {}
    if exc.status == 401:
        headers["WWW-Authenticate"] = WWW_AUTHENTICATE
    if isinstance(exc, MethodNotAllowed) and exc.allow:
        headers["Allow"] = exc.allow
    if exc.retriable:
        hint = exc.extra.get("retryAfterMs")
        secs = -(-hint // 1000) if isinstance(hint, int) and not isinstance(hint, bool) and hint > 0 else 1
        headers["Retry-After"] = str(max(1, secs))
    return headers


def is_retriable(exc: BaseException) -> bool:
    """Predicate for tenacity: retry only errors that say they are retriable."""
    return isinstance(exc, LeaseholdError) and exc.retriable


#: the longest request path a problem body repeats as its ``instance``
INSTANCE_MAX = 256


def to_problem(exc: LeaseholdError, *, instance: str | None = None) -> tuple[int, dict[str, Any]]:
    """The one mapping from an error to an RFC 9457 problem body and status.

    Details are written by us, never copied from drivers, so they carry no secrets or keys.
    """
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + exc.code,
        "title": exc.title,
        "status": exc.status,
        "detail": exc.detail,
        "retriable": exc.retriable,
    }
    if instance:  # the request's path, a caller's text: bounded like every detail we write
        body["instance"] = instance if len(instance) <= INSTANCE_MAX else instance[:INSTANCE_MAX] + "..."
    for k, v in exc.extra.items():
        body.setdefault(k, v)
    return exc.status, body
