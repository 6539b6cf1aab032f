"""HTTP forward auth: ``/v1/authz`` (and ``/v1/authz/<original path>``), any method.

The question comes from request headers (:func:`.mapping.authz_question`, names in
``--authz-headers``); the answer is the status code — 200 allowed (with the RateLimit fields of
the caller's own scope), 429 denied (``Retry-After``), 503 a ``closed`` rule without its store —
plus the problem body. This is what Envoy's ext_authz (HTTP service: it sends the original
method and appends the original path to ``path_prefix``) and Traefik's ForwardAuth (any non-2xx
answer goes to the client as is) expect. nginx's auth_request understands only 2xx/401/403: it
sends ``X-Leasehold-Deny-Status: 403`` and gets denials as 403 with the real status in
``X-Leasehold-Status`` (``deploy/gateways/nginx.conf`` turns that back into 429/503).

A mounted raw ASGI handler (every method, every path below ``/v1/authz``): no framework
request machinery, which would cost as much as the decision (see :mod:`region_agent.service.fastpath`). It authenticates the gateway itself (the same
token table as ``/v1/admit``): ``Authorization: Bearer <token>``, or the same value in
``X-Leasehold-Authorization`` for gateways that forward the client's own ``Authorization``
(Traefik). Errors are the agent's usual problem+json answers (401, 400/422, 503 while starting).

Where the identity comes from: with ``--authz-jwks`` (the nginx and Traefik configurations),
only from the client's own ``Authorization: Bearer <jwt>``, verified here (:mod:`.bearer`);
identity headers are ignored. A request without a valid token is asked as a failed
authentication (the caller's address alone, so guessing credentials spends the address window)
and answered 401 if that address may still knock, the address's 429 otherwise. Route groups in
``--authz-anonymous-routes`` (the pre-authentication routes, e.g. ``login``) are asked by the
address alone. Without ``--authz-jwks``, the identity headers of a gateway that authenticated
the caller itself (Envoy ``jwt_authn``, ``deploy/gateways/envoy-ext-authz.yaml``).

What the backend is handed: with ``--authz-jwks``, an allowed request's 200 carries the identity
the agent verified, under the question's own header names (by default ``X-Tenant-Id``,
``X-User-Id``, and ``X-Api-Key-Id`` when the token names a key), for the gateway to set on the
request it forwards in place of anything the client sent (``deploy/gateways/nginx.conf``:
``auth_request_set``; ``traefik.yml``: ``authResponseHeaders``). Nothing else of an identity:
never on a pre-authentication route, never without a verified token, never ``X-Service-Id`` (a
token's principal is its user, :mod:`.bearer`), never an identity the agent was only told. Every
value handed on was first a question's, whose wire types (:mod:`region_agent.models`) refuse a
claim no question can carry and one that is no identity text (``kernel.ids.ID_TEXT``: a control
character, or white space at either end a backend would trim into another identity): 422 before
anything is spent, as at every door. The bytes are built once per identity
(``Gateways.identity_answers``).

Every allowed request's 200 also carries the decision id it was decided under, under the
question's request id header name (``X-Request-Id``): the one the gateway sent in that header
(nginx's ``$request_id``, Envoy's ``x-request-id``), else the one the agent minted (Traefik, whose
file forwards no request id). The backend ends an export's concurrency slot with it (``POST
/v1/release``); ``traefik.yml`` copies it onto the request (``authResponseHeaders``). It is the
gateway's header or the agent's own, never one a client sent past a shipped gateway: none forwards
the client's to the agent. Nothing on a refusal (401, 422, a denial).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from litestar import asgi

from kernel.auth import SCOPE_KEY, authenticate
from kernel.caches import BoundedMemo
from kernel.errors import BadRequest, LeaseholdError, NotFound, Unauthorized, ValidationFailed
from kernel.http_errors import problem_answer

from .answer import authz_answer
from .mapping import (
    BadQuestion,
    authz_question,
    authz_route,
    failed_authentication,
    with_identity,
    without_identity,
)
from .refused_callers import RefusedCallers

if TYPE_CHECKING:
    from .bearer import Identity

log = logging.getLogger(__name__)

PATH = "/v1/authz"
refused_callers = RefusedCallers(log)  # a call without a valid gateway token, in this door's log
DENY_STATUSES = {"401": 401, "403": 403, "429": 429}
# no valid bearer token (with --authz-jwks), and the caller's address may still knock: the same
# answer whatever was wrong with the token (nothing tells an unknown key from a bad signature)
UNAUTHENTICATED = (401, {"content-type": "application/problem+json", "www-authenticate": "Bearer"},
                   b'{"type":"about:blank","title":"Unauthorized","status":401}', ())
IDENTITY_ANSWERS_MAX = 10_000  # verified identities whose answer headers are remembered (a memo)
RawHeaders = tuple[tuple[bytes, bytes], ...]


def decision_id_name(names: Any) -> bytes:
    """``Gateways.decision_id_name``: the header an allowed answer hands the decision id back in,
    the question's own request id header (``--authz-headers request_id=...``)."""
    return names.headers["request_id"].encode("latin-1")


def identity_memo() -> BoundedMemo[Identity, RawHeaders]:
    """``Gateways.identity_answers``: the answer headers of the identities this agent verified."""
    return BoundedMemo(IDENTITY_ANSWERS_MAX)


def identity_headers(names: Any, who: Identity) -> RawHeaders:
    """The answer headers handing the backend the verified ``who``: the question's header names
    (``--authz-headers``) for tenant, user and, when the token names one, API key; values in UTF-8
    (the text :func:`_headers` reads). ``who`` was a question already: its values are identity
    text, which a header carries as it is (``kernel.ids.ID_TEXT``)."""
    h = names.headers
    fields = (("tenant", who.tenant), ("user", who.user), ("api_key", who.api_key))
    return tuple((h[field].encode("latin-1"), value.encode("utf-8")) for field, value in fields if value is not None)


def _headers(scope: dict, wanted: frozenset[str]) -> dict[str, str]:
    """Lower-cased request headers; one of ``wanted`` given twice is refused (ambiguous).

    The values of ``wanted`` (the question's headers) are read as UTF-8, the text the other doors
    receive (JSON, protobuf strings): a user id sent by a gateway as the UTF-8 bytes of a token's
    claim names the same bucket here as through ``/v1/admit`` or RLS (read as Latin-1 it named
    another, so one principal had two). Bytes that are not UTF-8 are refused, never guessed."""
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        name = k.decode("latin-1").lower()
        if name in wanted:
            if name in out:
                raise BadQuestion("duplicate_header", f"header {name} given twice")
            try:
                out[name] = v.decode("utf-8")
            except UnicodeDecodeError:
                raise BadQuestion("bad_value", f"header {name} is not UTF-8 text") from None
        else:
            out[name] = v.decode("latin-1")
    return out


@asgi(PATH, is_mount=True, copy_scope=False, summary="Forward auth: the answer is the status code",
      description="Envoy ext_authz (HTTP), Traefik ForwardAuth, nginx auth_request. Any method; the original "
                  "path may follow /v1/authz. See region_agent/README.md for the headers.")
async def authz(scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]) -> None:
    """Mounted raw ASGI handler (every method, every path under ``/v1/authz``)."""
    gw = scope["app"].state.agent.gateways
    started = time.perf_counter()
    path = scope.get("raw_path", b"").decode("latin-1").split("?", 1)[0] or scope.get("path", "")
    status, headers, body, handed = await answer(gw, scope, path)
    gw.metrics.authz_calls.labels(str(status)).inc()
    gw.metrics.authz_latency.observe(time.perf_counter() - started)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.extend(handed)
    if scope["method"] == "HEAD":
        body = b""
    await send({"type": "http.response.start", "status": status,
                "headers": [*raw, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def answer(gw: Any, scope: dict, path: str) -> tuple[int, dict[str, str], bytes, RawHeaders]:
    """Status, headers and body of the answer, and the raw headers handing the backend an allowed
    request's decision id and verified identity (empty: not allowed; no identity: nothing verified)."""
    names = gw.names
    try:
        if path != PATH and not path.startswith(PATH + "/"):  # the mount also matched /v1/authzfoo
            raise NotFound("no such resource")
        hdrs = _headers(scope, frozenset(names.headers.values()) | {"authorization"})
        tokens = gw.gateway_tokens()
        if tokens is not None:
            alt = hdrs.get(names.headers["token"])
            try:
                who = authenticate(tokens, [("authorization", alt)] if alt is not None else scope.get("headers", ()))
            except Unauthorized:
                gw.metrics.authz_unauthenticated.labels("gateway").inc()
                peer = (scope.get("client") or ("unknown",))[0]
                refused_callers.log(peer, "forward-auth call")
                raise
            scope[SCOPE_KEY] = "gateway:" + who
        deny = hdrs.get(names.headers["deny_status"])
        if deny is not None and deny not in DENY_STATUSES:
            raise BadRequest(f"{names.headers['deny_status']} must be 401, 403 or 429")
        forwarded = path[len(PATH):] or None
        unauthenticated = False
        verified: Identity | None = None
        if gw.bearer is not None:  # identity only from the client's verified token (.bearer)
            if authz_route(names, hdrs, forwarded) in gw.anonymous_routes:
                hdrs = without_identity(names, hdrs)  # pre-authentication route: the address alone
            else:
                verified = gw.bearer.identity(hdrs.get("authorization"))
                if verified is None:
                    unauthenticated = True  # counted against the caller's address, never a tenant
                    hdrs = failed_authentication(names, hdrs)
                else:
                    hdrs = with_identity(names, hdrs, verified.tenant, verified.user, verified.api_key)
        # the one check of the identity's text, for the question and for what is handed on (a 422)
        q = authz_question(names, hdrs, method=scope["method"], forwarded_path=forwarded)
        identity: RawHeaders = ()
        if verified is not None:
            identity = gw.identity_answers.get(verified) or gw.identity_answers.put(
                verified, identity_headers(names, verified))
        (decision,) = await gw.decide([q], door="authz", carrier=scope.get("headers", ()))
        if unauthenticated and decision.allowed:
            gw.metrics.authz_unauthenticated.labels("client").inc()
            return UNAUTHENTICATED
        a = authz_answer(decision, deny_status=DENY_STATUSES[deny] if deny is not None else None)
        if a.status != 200:
            return a.status, a.headers, a.body, ()
        return a.status, a.headers, a.body, ((gw.decision_id_name, decision.decision_id.encode("latin-1")), *identity)
    except LeaseholdError as e:
        if isinstance(e, ValidationFailed):
            gw.metrics.authz_invalid.labels(e.reason if isinstance(e, BadQuestion) else "bad_value").inc()
        return (*problem_answer(e, PATH), ())  # the app's exception handler's answer


__all__ = ["PATH", "answer", "authz", "decision_id_name", "identity_headers", "identity_memo"]
