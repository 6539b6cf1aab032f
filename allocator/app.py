"""The allocator's HTTP API (Litestar). Thin: every route calls :class:`allocator.writer.Writer`
or :class:`allocator.election.Election`.

Errors are answered by the kernel's one mapper (:mod:`kernel.http_errors`, shared with the agent):
problem+json for every error, Litestar's own client errors translated to the same classes; a body
or parameter that does not fit the schema is a 400 here.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, FromQuery, JSONBody

from kernel import tracing
from kernel.auth import SCOPE_KEY, RegionAuth, TokenTable, require_region
from kernel.bundle import Bundle, load_bundle_file
from kernel.errors import BadRequest, LeaseholdError, Unavailable, ValidationFailed
from kernel.etcd_store import EtcdRefused, EtcdStore, TxnBuilder, prefix_range_end
from kernel.http_errors import exception_handlers, problem_response
from kernel.ids import LEASE_ID, LEASE_ID_RE, REGION, REGION_RE, human
from kernel.jsonbody import StrictJSONRequest
from kernel.openapi_problems import document_problems
from kernel.policy_store import PolicyStore
from kernel.signing import TrustedKeys
from kernel.wire import (
    LeaseBatchRequest,
    LeaseBatchResponse,
    LeaseGrant,
    LeaseRequest,
    PoolSummary,
    PoolWindowView,
    ShardedLeaderInfo,
    ShardMap,
    UsageBatchRequest,
    UsageBatchResponse,
    UsageReceipt,
    UsageReport,
)

from .committer import OpenWrites
from .compaction import Compactor
from .control.follow import AllocatorPolicy
from .election import Election
from .fastpath import batch_fast_path
from .metrics import CONTENT_TYPE, AllocatorMetrics
from .records import GrantRecord, Keys
from .session import Session
from .settings import AllocatorSettings
from .writer import Writer, wall_ms

log = logging.getLogger(__name__)
VALIDATION_STATUS = 400  # a body or parameter that does not fit the schema (the agent answers 422)

Guard = Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler | None], Any]


async def check_caller(state: State, connection: ASGIConnection[Any, Any, Any, Any],
                       handler: BaseRouteHandler | None) -> None:
    """Run the app's check of the caller, by default :class:`kernel.auth.RegionAuth` (a region's
    bearer token, else 401); none with ``--auth-disabled``. ``create_app(auth_guard=...)`` plugs
    another check in here. ``handler``: None before routing (:func:`lease_spans`)."""
    check = state.get("auth_guard")
    if check is not None:
        result = check(connection, handler)
        if hasattr(result, "__await__"):
            await result


async def region_auth_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Authentication of the lease endpoints (:func:`check_caller`)."""
    await check_caller(connection.app.state, connection, handler)


# -- routes -------------------------------------------------------------------------------------
def _writer(state: State) -> Writer:
    writer: Writer = state.writer
    return writer


def _election(state: State) -> Election:
    election: Election = state.election
    return election


def _check_lease_id(lease_id: str) -> None:
    if not LEASE_ID_RE.match(lease_id):
        raise BadRequest(f"leaseId must match {human(LEASE_ID)}")


@post("/v1/leases", status_code=200, guards=[region_auth_guard])
async def post_lease(request: Request[Any, Any, Any], data: JSONBody[LeaseRequest], state: State) -> LeaseGrant:
    require_region(request.scope, data.region)
    return await _writer(state).grant(data)


class _ResultDoc(msgspec.Struct, rename="camel"):
    """The members every batch result may carry: its lease id, and a ``LeaseError``'s."""

    lease_id: str
    granted: int | None = None
    status: int | None = None
    code: str | None = None
    detail: str | None = None


class BatchResultDoc(_ResultDoc):
    """OpenAPI shape of one batch result: a ``LeaseGrant`` or a ``LeaseError`` (untagged union)."""


class LeaseBatchResponseDoc(msgspec.Struct, rename="camel"):
    results: list[BatchResultDoc]


class UsageResultDoc(_ResultDoc):
    """OpenAPI shape of one usage batch result: a ``UsageReceipt`` or a ``LeaseError``."""

    spent: int | None = None
    returned: int | None = None
    window_open: bool | None = None
    replayed: bool | None = None


class UsageBatchResponseDoc(msgspec.Struct, rename="camel"):
    results: list[UsageResultDoc]


@post("/v1/leases/batch", status_code=200, guards=[region_auth_guard])
async def post_batch(request: Request[Any, Any, Any], data: JSONBody[LeaseBatchRequest],
                     state: State) -> Response[LeaseBatchResponseDoc]:
    """Grants for many pools in one request; results in request order, each a grant or an error.
    (The schema documents the union loosely: results are ``LeaseGrant`` or ``LeaseError`` objects.)"""
    _check_batch(request, data.requests, "requests")
    body = LeaseBatchResponse(results=await _writer(state).grant_many(data.requests))
    # the body goes out encoded as is; the annotation gives the OpenAPI schema its shape
    return Response(content=msgspec.json.encode(body), media_type=MediaType.JSON)  # type: ignore[arg-type]  # bytes where the annotation names the documented shape


def _check_batch(request: Request[Any, Any, Any], items: list[LeaseRequest] | list[UsageReport], member: str) -> None:
    """Every item of a batch is the caller's own region's, and no lease id is there twice."""
    for r in items:
        require_region(request.scope, r.region)
    ids = [r.lease_id for r in items]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("a batch must not repeat a leaseId", errors=[f"{member}: duplicate leaseId"])


@post("/v1/leases/{lease_id:str}/usage", status_code=200, guards=[region_auth_guard])
async def post_usage(request: Request[Any, Any, Any], lease_id: FromPath[str], data: JSONBody[UsageReport],
                     state: State) -> UsageReceipt:
    _check_lease_id(lease_id)
    if data.lease_id != lease_id:
        raise BadRequest(f"body leaseId {data.lease_id!r} does not match the path's {lease_id!r}")
    require_region(request.scope, data.region)  # lease ids are looked up in the region's own namespace
    return await _writer(state).report(data)


@post("/v1/usage/batch", status_code=200, guards=[region_auth_guard])
async def post_usage_batch(request: Request[Any, Any, Any], data: JSONBody[UsageBatchRequest],
                           state: State) -> Response[UsageBatchResponseDoc]:
    """Usage reports of many leases in one request (committed in few transactions); results in
    request order, each a receipt or an error. Same rules per item as
    ``POST /v1/leases/{leaseId}/usage`` (the region's own lease ids, ``closedEarly``)."""
    _check_batch(request, data.reports, "reports")
    body = UsageBatchResponse(results=await _writer(state).report_many(data.reports))
    # the body goes out encoded as is; the annotation gives the OpenAPI schema its shape
    return Response(content=msgspec.json.encode(body), media_type=MediaType.JSON)  # type: ignore[arg-type]  # bytes where the annotation names the documented shape


@get("/v1/leases/{lease_id:str}", guards=[region_auth_guard])
async def get_lease(request: Request[Any, Any, Any], lease_id: FromPath[str], state: State,
                    region: FromQuery[str | None] = None) -> GrantRecord:
    """A lease of the calling region (``region`` defaults to the authenticated region and is
    required with authentication off). Another region's lease and no lease answer the same 404."""
    _check_lease_id(lease_id)
    caller = request.scope.get(SCOPE_KEY)
    region = region or (caller if isinstance(caller, str) else None)
    if region is None:
        raise BadRequest("the region query parameter is required when authentication is disabled")
    if not REGION_RE.match(region):
        raise BadRequest(f"region must match {human(REGION)}")
    require_region(request.scope, region)
    return await _writer(state).get_record(region, lease_id)


@get("/v1/leader")
async def get_leader(state: State) -> ShardedLeaderInfo:
    """The allocator leader (of shard 0 when sharded: see ``/v1/shards`` for the leader of a pool's
    shard), the shard count and how many shards this replica leads."""
    return _election(state).leader_info()


@get("/v1/shards")
async def get_shards(state: State) -> ShardMap:
    """Which replica leads each shard of leadership, as this replica last read etcd; a pool's shard
    is ``kernel.shards.shard_of(pool, shards)``. Any replica answers."""
    return _election(state).shard_map()


@get("/v1/pools")
async def get_pools(state: State) -> list[PoolSummary]:
    return _writer(state).summaries()


@get("/v1/pools/{pool_id:str}")
async def get_pool(pool_id: FromPath[str], state: State) -> PoolWindowView:
    return await _writer(state).window_view(pool_id)


@get("/healthz", media_type=MediaType.JSON)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", media_type=MediaType.JSON)
async def readyz(state: State) -> Response[Any]:
    """Ready = this replica answers: started, its shard configuration agrees with etcd's, not
    shutting down. An etcd outage does not make it unready (it answers a retriable 503 and the
    agents fall back to their bounded allowances either way); etcd's health is ``/v1/health/store``."""
    if state.get("shutting_down"):
        return problem_response(Unavailable("not ready: shutting down"))
    election: Election | None = state.get("election")
    if election is None:
        return problem_response(Unavailable("not ready: starting"))
    if election.config_error:
        return problem_response(Unavailable(f"not ready: {election.config_error}"))
    body: dict[str, Any] = {"status": "ready", "role": _role(election), "epoch": election.leader.epoch,
                            "shards": election.shards, "shardsLed": len(election.led)}
    return Response(content=body, media_type=MediaType.JSON)


def _role(election: Election) -> str:
    if not election.role_known:
        return "unknown"
    return "leader" if election.is_leader else "follower"


@get("/v1/health/store", media_type=MediaType.JSON)
async def store_health(state: State) -> Response[Any]:
    """200 while etcd answers and this replica knows its role, else 503 (grants are then refused
    as retriable and the agents spend their fallback allowances): ``etcd`` is ``unreachable``, or
    ``refusing`` with ``refused`` naming per kind of call (``read``, ``write``, ``lease``,
    ``keepalive``, ``grants``: the grant and usage transactions) the cause etcd refuses it for (``auth``, ``permission``, ``nospace``, ``tls``). For monitoring, not a probe."""
    election: Election | None = state.get("election")
    if election is None:
        return problem_response(Unavailable("etcd not connected yet"))
    refused = {kind: e.cause for kind, e in election.store.refused.items()}
    body: dict[str, Any] = {"etcd": "reachable" if election.etcd_ok else "unreachable", "role": _role(election),
                            "epoch": election.leader.epoch}
    if refused:  # etcd answers but refuses this replica's reads or writes: no grant commits
        body |= {"etcd": "refusing", "refused": refused}
        causes = "; ".join(f"{kind} calls: {EtcdRefused.CAUSES[c]}" for kind, c in sorted(refused.items()))
        return problem_response(Unavailable(f"etcd refuses this replica's {causes}", extra=body))
    if not (election.etcd_ok and election.role_known):
        return problem_response(Unavailable("etcd unreachable or role unknown", extra=body))
    return Response(content=body, media_type=MediaType.JSON)


@get("/metrics", media_type=CONTENT_TYPE)
async def metrics(state: State) -> Response[bytes]:
    return Response(content=_writer(state).metrics.render(), media_type=CONTENT_TYPE)


def lease_spans(state_of: Callable[[], State]) -> Callable[[Any], Any]:
    """ASGI middleware factory: with tracing on, a ``leasehold.lease_request`` server span per lease
    and usage request of an authenticated region, child of the region's span when it sent a
    ``traceparent`` (kernel.tracing); the committer links each transaction to the spans of the
    requests it carries. The caller is checked first (:func:`check_caller`, once per request: the
    route's guard and the fast path take its result): one who does not pass gets its 401 and no span,
    so neither its trace context nor its path reaches the collector."""

    def middleware(app: Any) -> Any:
        async def serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if not tracing.ENABLED or scope["type"] != "http" \
                    or not scope["path"].startswith(("/v1/leases", "/v1/usage")):
                await app(scope, receive, send)
                return
            try:
                await check_caller(state_of(), ASGIConnection(cast(Any, scope)), None)
            except LeaseholdError:
                await app(scope, receive, send)  # the route's guard answers the 401
                return
            with tracing.span("leasehold.lease_request", kind=tracing.SpanKind.SERVER,
                              parent=tracing.context_of(scope.get("headers", ())),
                              attributes={"http.request.method": scope["method"], "url.path": scope["path"]}):
                await app(scope, receive, send)

        return serve

    return middleware


# -- assembly -----------------------------------------------------------------------------------
def etcd_credentials(settings: AllocatorSettings) -> dict[str, Any]:
    """etcd user and password (password from LEASEHOLD_ALLOCATOR_ETCD_PASSWORD or a file), and
    the TLS channel credentials of the link (``allocator.settings.etcd_tls``)."""
    from .settings import etcd_tls

    out: dict[str, Any] = {"tls": etcd_tls(settings)}
    if not settings.etcd_user:
        return out
    import os

    password = os.environ.get("LEASEHOLD_ALLOCATOR_ETCD_PASSWORD")
    if not password and settings.etcd_password_file:
        with open(settings.etcd_password_file) as f:
            password = f.read().strip()
    return {**out, "user": settings.etcd_user, "password": password or ""}


# what each refusal at start asks the operator to check (EtcdRefused.cause)
_START_REFUSALS = {
    "auth": "etcd refused the allocator's credentials (authentication failed for user {user}): check --etcd-user "
            "and its password (LEASEHOLD_ALLOCATOR_ETCD_PASSWORD or --etcd-password-file), and that the user exists "
            "(deploy/etcd/leasehold-roles.sh creates it)",
    "permission": "etcd denied a permission the allocator needs (user {user}): its role must readwrite pools/, "
                  "grants/, members/, leader (prefix), shards and compaction and read policy/ under {prefix} "
                  "(deploy/etcd/leasehold-roles.sh grants them)",
    "tls": "the TLS handshake with etcd failed on every endpoint: etcd's certificate must verify against "
           "--etcd-ca-file and name the endpoint's host, and etcd must accept --etcd-cert-file (signed by its "
           "--trusted-ca-file, not expired)",
}


async def etcd_refusal(settings: AllocatorSettings) -> str | None:
    """Why the allocator must not start on its etcd — the credentials, a permission of its role or
    the TLS handshake refused (:class:`kernel.etcd_store.EtcdRefused`) — asked once before the
    server starts, so that ``python -m allocator`` refuses with one line (no credential in it) and
    exit code 2 like its other refusals. Every permission the allocator uses is checked by one
    transaction that can never apply (its compare is never true; etcd checks the permissions of
    both branches first). None when there is nothing to refuse, also when etcd does not answer now
    or refuses writes for lack of space (NOSPACE): the allocator then starts, and says so."""
    store = EtcdStore(settings.etcd, timeout_s=settings.etcd_timeout_ms / 1000, report_refusals=False,
                      **etcd_credentials(settings))
    keys = Keys(settings.prefix, settings.shards)
    probe = TxnBuilder()
    probe.created_at(keys.member(settings.node_id), -1)  # never true: nothing below is applied
    probe.put_many((k, b"", 0) for k in (keys.member(settings.node_id), keys.leader, keys.leaders + b"0",
                                          keys.shard_count, keys.compaction, keys.window("access-check", 0),
                                          keys.grant("access-check", "access-check")))
    probe.get_range(keys.pools, prefix_range_end(keys.pools))
    probe.get_range(keys.grants, prefix_range_end(keys.grants))
    probe.get(f"{settings.prefix}policy/current".encode())
    try:
        await store.commit(probe)
    except EtcdRefused as e:
        if e.cause == "nospace":
            return None
        user = settings.etcd_user or "(none: --etcd-user is not set, and etcd's authentication is on)"
        return "refusing to start: " + _START_REFUSALS[e.cause].format(user=user, prefix=settings.prefix)
    except LeaseholdError:
        return None  # not answering now: the start goes on, the election says when it answers
    finally:
        await store.close()
    return None


def create_app(settings: AllocatorSettings, *, bundle: Bundle | None = None,
               clock: Callable[[], int] = wall_ms, auth_guard: Guard | None = None,
               fast_path: bool = True, install_signal_handlers: bool = False) -> Litestar:
    """Build the app. The etcd client, election and writer start in the app's lifespan.
    ``fast_path``: serve the batch routes' common case without Litestar (``allocator.fastpath``)."""
    trusted = TrustedKeys.from_files(settings.policy_public_keys)
    # the start bundle too (raises SignatureRefused, a PolicyError), verified before it is validated
    bundle = bundle if bundle is not None else load_bundle_file(settings.policy, verify=trusted.check)
    trusted.check(bundle)
    if auth_guard is None and not settings.auth_disabled:
        auth_guard = RegionAuth(TokenTable.parse(settings.region_tokens, settings.region_tokens_file))
    m = AllocatorMetrics()
    m.describe_pools(bundle.pools)
    m.connections.follow(settings.http_max_connections)
    tracing.setup("leasehold-allocator", settings.otlp_endpoint, settings.trace_sample_ratio)  # off without an endpoint

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        store = EtcdStore(settings.etcd, timeout_s=settings.etcd_timeout_ms / 1000, observe=m.observe_etcd,
                          max_txn_ops=settings.etcd_max_txn_ops or None, **etcd_credentials(settings))
        keys = Keys(settings.prefix, settings.shards)
        open_writes = OpenWrites()
        election = Election(Session(store, settings.election_ttl_s), keys, node_id=settings.node_id,
                            url=settings.url, drain=open_writes.drain, on_change=m.on_leadership)
        m.follow_election(election)
        m.follow_store(store)
        writer = Writer(store, election, bundle.pools, keys=keys, open_writes=open_writes, metrics=m, clock=clock)
        app.state.writer, app.state.election = writer, election
        writer.start()
        election.start()
        compactor = Compactor(store, election, keys.compaction, node_id=settings.node_id,
                              interval_s=settings.etcd_compaction_interval_s, metrics=m)
        if settings.etcd_compaction_interval_s:
            compactor.start()
        follower = AllocatorPolicy(bundle, writer.use_pools, m, trusted)
        app.state.policy = follower
        watcher = follower.watcher(PolicyStore(store, settings.prefix, trusted=trusted),
                                   settings.policy_reread_ms / 1000)
        if settings.policy_from_etcd:
            watcher.start()
        undo_termination = None
        if install_signal_handlers:  # SIGTERM: unready at once, before uvicorn drains
            from kernel.httpserver import on_termination

            def terminating() -> None:
                app.state.shutting_down = True
            undo_termination = on_termination(terminating)
        try:
            yield
        finally:
            app.state.shutting_down = True
            if undo_termination is not None:
                undo_termination()
            await watcher.stop()
            await compactor.stop()
            await election.stop()
            await writer.stop()
            await store.close()
            tracing.shutdown()

    handlers: list[Any] = [post_lease, post_batch, post_usage, post_usage_batch, get_lease, get_leader, get_shards, get_pools,
                           get_pool, healthz, readyz, store_health, metrics]
    middleware: list[Any] = [lease_spans(lambda: app.state)]  # plain ASGI middleware (scope as a dict)
    if fast_path:
        middleware.append(batch_fast_path(lambda: app.state, settings.max_body_bytes))
    app = Litestar(
        route_handlers=handlers,
        lifespan=[lifespan],
        # logging stays as __main__ set it up: Litestar's default config would route every record
        # through a queue listener thread, and what is queued when SIGTERM ends the process (the
        # shutdown report line) is lost
        logging_config=None,
        state=State({"auth_guard": auth_guard, "settings": settings}),
        middleware=middleware,
        exception_handlers=exception_handlers(validation_status=VALIDATION_STATUS),
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Leasehold allocator", version="1.0.0", path="/schema"),
        request_class=StrictJSONRequest,  # kernel.jsonbody: application/json only, strict typed decoding
        debug=False,
    )
    document_problems(app)
    return app
