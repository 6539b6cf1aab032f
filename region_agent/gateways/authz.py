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
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import asgi

from kernel.auth import SCOPE_KEY, authenticate
from kernel.errors import BadRequest, LeaseholdError, NotFound, ValidationFailed
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

PATH = "/v1/authz"
DENY_STATUSES = {"401": 401, "403": 403, "429": 429}
# no valid bearer token (with --authz-jwks), and the caller's address may still knock: the same
# answer whatever was wrong with the token (nothing tells an unknown key from a bad signature)
UNAUTHENTICATED = (401, {"content-type": "application/problem+json", "www-authenticate": "Bearer"},
                   b'{"type":"about:blank","title":"Unauthorized","status":401}')


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
    status, headers, body = await answer(gw, scope, path)
    gw.metrics.authz_calls.labels(str(status)).inc()
    gw.metrics.authz_latency.observe(time.perf_counter() - started)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if scope["method"] == "HEAD":
        body = b""
    await send({"type": "http.response.start", "status": status,
                "headers": [*raw, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def answer(gw: Any, scope: dict, path: str) -> tuple[int, dict[str, str], bytes]:
    names = gw.names
    try:
        if path != PATH and not path.startswith(PATH + "/"):  # the mount also matched /v1/authzfoo
            raise NotFound("no such resource")
        hdrs = _headers(scope, frozenset(names.headers.values()) | {"authorization"})
        tokens = gw.gateway_tokens()
        if tokens is not None:
            alt = hdrs.get(names.headers["token"])
            who = authenticate(tokens, [("authorization", alt)] if alt is not None else scope.get("headers", ()))
            scope[SCOPE_KEY] = "gateway:" + who
        deny = hdrs.get(names.headers["deny_status"])
        if deny is not None and deny not in DENY_STATUSES:
            raise BadRequest(f"{names.headers['deny_status']} must be 401, 403 or 429")
        forwarded = path[len(PATH):] or None
        unauthenticated = False
        if gw.bearer is not None:  # identity only from the client's verified token (.bearer)
            if authz_route(names, hdrs, forwarded) in gw.anonymous_routes:
                hdrs = without_identity(names, hdrs)  # pre-authentication route: the address alone
            else:
                who = gw.bearer.identity(hdrs.get("authorization"))
                if who is None:
                    unauthenticated = True  # counted against the caller's address, never a tenant
                    hdrs = failed_authentication(names, hdrs)
                else:
                    hdrs = with_identity(names, hdrs, who.tenant, who.user, who.api_key)
        q = authz_question(names, hdrs, method=scope["method"], forwarded_path=forwarded)
        (decision,) = await gw.decide([q], door="authz", carrier=scope.get("headers", ()))
        if unauthenticated and decision.allowed:
            return UNAUTHENTICATED
        a = authz_answer(decision, deny_status=DENY_STATUSES[deny] if deny is not None else None)
        return a.status, a.headers, a.body
    except LeaseholdError as e:
        if isinstance(e, ValidationFailed):
            gw.metrics.authz_invalid.labels(e.reason if isinstance(e, BadQuestion) else "bad_value").inc()
        return problem_answer(e, PATH)  # the app's exception handler's answer


__all__ = ["PATH", "answer", "authz"]
