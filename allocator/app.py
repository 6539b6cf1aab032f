"""The allocator's HTTP API (Litestar). Thin: every route calls :class:`allocator.engine.Engine`.

Errors: one handler turns every ``LeaseholdError`` into problem+json via ``to_problem``;
Litestar's own client errors (bad JSON, schema validation, unknown route, body too large)
are mapped to the same problem shape; anything else is a logged 500 problem with no detail.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.exceptions import HTTPException, NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, JSONBody

from kernel.auth import SCOPE_KEY, RegionAuth, TokenTable, require_region
from kernel.bundle import Bundle, load_bundle_file
from kernel.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    LeaseholdError,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    to_problem,
)
from kernel.etcd_store import EtcdStore
from kernel.etcd_tls import credentials as tls_credentials
from kernel.openapi_problems import document_problems
from kernel.policy_store import PolicyStore
from kernel.shards import SHARD_HASH
from kernel.wire import (
    LeaderInfo,
    LeaseBatchRequest,
    LeaseBatchResponse,
    LeaseGrant,
    LeaseRequest,
    PoolSummary,
    PoolWindowView,
    ShardedLeaderInfo,
    ShardLeader,
    ShardMap,
    UsageBatchRequest,
    UsageBatchResponse,
    UsageReceipt,
    UsageReport,
)

from .compaction import Compactor
from .control.follow import AllocatorPolicy
from .election import Election
from .engine import Engine, GrantRecord, wall_ms
from .fastpath import batch_fast_path
from .metrics import CONTENT_TYPE, AllocatorMetrics
from .settings import AllocatorSettings
from .shard_election import ShardElection

log = logging.getLogger("allocator.app")

PROBLEM_JSON = "application/problem+json"
LEASE_ID_RE = re.compile(r"[A-Za-z0-9._:-]{8,96}")

Guard = Callable[[ASGIConnection, BaseRouteHandler], Any]


async def region_auth_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Authentication hook for the lease endpoints. A later task fills it with per-region
    bearer tokens (raise ``Unauthorized`` / ``Forbidden`` from ``kernel.errors``);
    today every caller is accepted. ``create_app(auth_guard=...)`` plugs a check in here."""
    check = connection.app.state.get("auth_guard")
    if check is not None:
        result = check(connection, handler)
        if hasattr(result, "__await__"):
            await result


# -- error mapping ------------------------------------------------------------------------------
def problem_response(exc: LeaseholdError, path: str | None = None) -> Response[Any]:
    status, body = to_problem(exc, instance=path)
    headers = {}
    if exc.retriable:
        headers["Retry-After"] = "1"
    return Response(content=body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _leasehold_handler(request: Request, exc: LeaseholdError) -> Response[Any]:
    return problem_response(exc, request.url.path)


def _http_handler(request: Request, exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    detail = exc.detail or "request rejected"
    if status == 413:
        err: LeaseholdError = PayloadTooLarge(detail)
    elif status == 404:
        err = NotFound(f"no route {request.url.path}")
    elif status == 401 or isinstance(exc, NotAuthorizedException):
        err = Unauthorized(detail)
    elif status == 403 or isinstance(exc, PermissionDeniedException):
        err = Forbidden(detail)
    elif status == 405:
        err = BadRequest(f"method {request.method} not allowed on {request.url.path}")
        err.status = 405
    elif status == 400 and exc.extra:
        items = exc.extra if isinstance(exc.extra, list) else [exc.extra]
        problems = [(f"{e['key']}: " if isinstance(e, dict) and e.get("key") else "")
                    + (str(e.get("message", e)) if isinstance(e, dict) else str(e)) for e in items]
        err = ValidationFailed(f"request body failed validation: {'; '.join(problems)}", errors=problems)
        err.status = 400
    elif 400 <= status < 500:
        err = BadRequest(detail)
        err.status = status
    else:
        log.error("HTTP %s on %s: %s", status, request.url.path, detail)
        err = LeaseholdError("internal error")
    return problem_response(err, request.url.path)


def _internal_handler(request: Request, exc: Exception) -> Response[Any]:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return problem_response(LeaseholdError("internal error"), request.url.path)


# -- routes -------------------------------------------------------------------------------------
def _engine(state: State) -> Engine:
    return state.engine  # type: ignore[no-any-return]


def _check_lease_id(lease_id: str) -> None:
    if not LEASE_ID_RE.fullmatch(lease_id):
        raise BadRequest(f"leaseId must match {LEASE_ID_RE.pattern}")


@post("/v1/leases", status_code=200, guards=[region_auth_guard])
async def post_lease(request: Request, data: JSONBody[LeaseRequest], state: State) -> LeaseGrant:
    require_region(request.scope, data.region)
    return await _engine(state).grant(data)


class BatchResultDoc(msgspec.Struct, rename="camel"):
    """OpenAPI shape of one batch result: a ``LeaseGrant`` or a ``LeaseError`` (untagged union)."""

    lease_id: str
    granted: int | None = None
    status: int | None = None
    code: str | None = None
    detail: str | None = None


class LeaseBatchResponseDoc(msgspec.Struct, rename="camel"):
    results: list[BatchResultDoc]


class UsageResultDoc(msgspec.Struct, rename="camel"):
    """OpenAPI shape of one usage batch result: a ``UsageReceipt`` or a ``LeaseError``."""

    lease_id: str
    granted: int | None = None
    spent: int | None = None
    returned: int | None = None
    window_open: bool | None = None
    replayed: bool | None = None
    status: int | None = None
    code: str | None = None
    detail: str | None = None


class UsageBatchResponseDoc(msgspec.Struct, rename="camel"):
    results: list[UsageResultDoc]


@post("/v1/leases/batch", status_code=200, guards=[region_auth_guard])
async def post_batch(request: Request, data: JSONBody[LeaseBatchRequest],
                     state: State) -> Response[LeaseBatchResponseDoc]:
    """Grants for many pools in one request; results in request order, each a grant or an error.
    (The schema documents the union loosely: results are ``LeaseGrant`` or ``LeaseError`` objects.)"""
    for r in data.requests:
        require_region(request.scope, r.region)
    ids = [r.lease_id for r in data.requests]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("a batch must not repeat a leaseId", errors=["requests: duplicate leaseId"])
    body = LeaseBatchResponse(results=await _engine(state).grant_many(data.requests))
    return Response(content=msgspec.json.encode(body), media_type=MediaType.JSON)


@post("/v1/leases/{lease_id:str}/usage", status_code=200, guards=[region_auth_guard])
async def post_usage(request: Request, lease_id: FromPath[str], data: JSONBody[UsageReport],
                     state: State) -> UsageReceipt:
    _check_lease_id(lease_id)
    if data.lease_id != lease_id:
        raise BadRequest(f"body leaseId {data.lease_id!r} does not match the path's {lease_id!r}")
    require_region(request.scope, data.region)
    # a stored lease of another region: 403 for an authenticated caller (checked on the record the
    # engine reads anyway), 409 otherwise
    foreign = Forbidden if request.scope.get(SCOPE_KEY) is not None else Conflict
    return await _engine(state).report(data, foreign=foreign)


@post("/v1/usage/batch", status_code=200, guards=[region_auth_guard])
async def post_usage_batch(request: Request, data: JSONBody[UsageBatchRequest],
                           state: State) -> Response[UsageBatchResponseDoc]:
    """Usage reports of many leases in one request (committed in few transactions); results in
    request order, each a receipt or an error. Same rules per item as
    ``POST /v1/leases/{leaseId}/usage``."""
    for r in data.reports:
        require_region(request.scope, r.region)
    ids = [r.lease_id for r in data.reports]
    if len(set(ids)) != len(ids):
        raise ValidationFailed("a batch must not repeat a leaseId", errors=["reports: duplicate leaseId"])
    foreign = Forbidden if request.scope.get(SCOPE_KEY) is not None else Conflict
    body = UsageBatchResponse(results=await _engine(state).report_many(data.reports, foreign=foreign))
    return Response(content=msgspec.json.encode(body), media_type=MediaType.JSON)


@get("/v1/leases/{lease_id:str}", guards=[region_auth_guard])
async def get_lease(request: Request, lease_id: FromPath[str], state: State) -> GrantRecord:
    _check_lease_id(lease_id)
    record = await _engine(state).get_record(lease_id)
    require_region(request.scope, record.grant.region)
    return record


@get("/v1/leader")
async def get_leader(state: State) -> LeaderInfo:
    """The allocator leader (unsharded), or the leader of shard 0 with the shard count and how many
    shards this replica leads (sharded: see ``/v1/shards`` for the leader of a pool's shard)."""
    election = _engine(state).election
    info = election.info()
    if isinstance(election, ShardElection):
        return ShardedLeaderInfo(node_id=info.node_id, url=info.url, epoch=info.epoch, is_self=info.is_self,
                                 shards=election.shards, leading=len(election.led))
    return info


@get("/v1/shards")
async def get_shards(state: State) -> ShardMap:
    """Which replica leads each shard of leadership, as this replica last read etcd; a pool's shard
    is ``kernel.shards.shard_of(pool, shards)``. Any replica answers."""
    election = _engine(state).election
    if isinstance(election, ShardElection):
        return election.shard_map()
    settings: AllocatorSettings = state.settings
    lead = election.leader
    return ShardMap(shards=1, hash=SHARD_HASH, node_id=settings.node_id, url=settings.url, revision=lead.epoch or 0,
                    members=[], leaders=[ShardLeader(shard=0, node_id=lead.node_id, url=lead.url, epoch=lead.epoch)])


@get("/v1/pools")
async def get_pools(state: State) -> list[PoolSummary]:
    return _engine(state).summaries()


@get("/v1/pools/{pool_id:str}")
async def get_pool(pool_id: FromPath[str], state: State) -> PoolWindowView:
    return await _engine(state).window_view(pool_id)


@get("/healthz", media_type=MediaType.JSON)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", media_type=MediaType.JSON)
async def readyz(state: State) -> Response[Any]:
    election = _engine(state).election
    if isinstance(election, ShardElection) and election.config_error:
        return problem_response(Unavailable(f"not ready: {election.config_error}"))
    if not (election.etcd_ok and election.role_known):
        return problem_response(Unavailable("not ready: etcd unreachable or role unknown",
                                            extra={"etcd": election.etcd_ok, "roleKnown": election.role_known}))
    body: dict[str, Any] = {"status": "ready", "role": "leader" if election.is_leader else "follower",
                            "epoch": election.leader.epoch}
    if isinstance(election, ShardElection):
        body |= {"shards": election.shards, "shardsLed": len(election.led)}
    return Response(content=body, media_type=MediaType.JSON)


@get("/metrics", media_type=CONTENT_TYPE)
async def metrics(state: State) -> Response[bytes]:
    return Response(content=_engine(state).metrics.render(), media_type=CONTENT_TYPE)


# -- assembly -----------------------------------------------------------------------------------
def etcd_credentials(settings: AllocatorSettings) -> dict[str, Any]:
    """etcd user and password (password from LEASEHOLD_ALLOCATOR_ETCD_PASSWORD or a file), and
    TLS channel credentials when --etcd-ca-file is set."""
    out: dict[str, Any] = {}
    if settings.etcd_ca_file:
        out["tls"] = tls_credentials(settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file)
    if not settings.etcd_user:
        return out
    import os

    password = os.environ.get("LEASEHOLD_ALLOCATOR_ETCD_PASSWORD")
    if not password and settings.etcd_password_file:
        with open(settings.etcd_password_file) as f:
            password = f.read().strip()
    return {**out, "user": settings.etcd_user, "password": password or ""}


def create_app(settings: AllocatorSettings, *, bundle: Bundle | None = None,
               clock: Callable[[], int] = wall_ms, auth_guard: Guard | None = None,
               fast_path: bool = True) -> Litestar:
    """Build the app. The etcd client, election and committer start in the app's lifespan.
    ``fast_path``: serve the batch routes' common case without Litestar (``allocator.fastpath``)."""
    bundle = bundle if bundle is not None else load_bundle_file(settings.policy)
    pools = {p.id: p for p in bundle.pools}
    if auth_guard is None and not settings.auth_disabled:
        auth_guard = RegionAuth(TokenTable.parse(settings.region_tokens, settings.region_tokens_file))
    m = AllocatorMetrics()
    m.describe_pools(bundle.pools)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        store = EtcdStore(settings.etcd, timeout_s=settings.etcd_timeout_ms / 1000, observe=m.observe_etcd,
                          max_txn_ops=settings.etcd_max_txn_ops or None, **etcd_credentials(settings))
        engine: Engine
        election: Election | ShardElection

        def on_change(leading: bool, epoch: int | None) -> None:
            m.on_leader_change(leading, epoch if epoch is not None else election.leader.epoch)
            engine.invalidate()

        def on_shard_change(shard: int, leading: bool, epoch: int | None) -> None:
            assert isinstance(election, ShardElection)
            m.on_shard_change(leading, len(election.led), election.leader.epoch)
            engine.invalidate(shard)

        if settings.shards == 1:
            election = Election(store, f"{settings.prefix}leader".encode(), node_id=settings.node_id,
                                url=settings.url, ttl_s=settings.election_ttl_s, on_change=on_change)
        else:
            election = ShardElection(store, settings.prefix, shards=settings.shards, node_id=settings.node_id,
                                     url=settings.url, ttl_s=settings.election_ttl_s, on_change=on_shard_change)
        engine = Engine(store, election, pools, prefix=settings.prefix, metrics=m, clock=clock)
        if isinstance(election, ShardElection):
            election.drain = engine.drain
        app.state.engine = engine
        engine.start()
        election.start()
        compactor = Compactor(store, election, f"{settings.prefix}compaction".encode(), node_id=settings.node_id,
                              interval_s=settings.etcd_compaction_interval_s, metrics=m)
        if settings.etcd_compaction_interval_s:
            compactor.start()
        follower = AllocatorPolicy(bundle, engine, m)
        app.state.policy = follower
        watcher = follower.watcher(PolicyStore(store, settings.prefix), settings.policy_reread_ms / 1000)
        if settings.policy_from_etcd:
            watcher.start()
        try:
            yield
        finally:
            await watcher.stop()
            await compactor.stop()
            await election.stop()
            await engine.stop()
            await store.close()

    handlers: list[Any] = [post_lease, post_batch, post_usage, post_usage_batch, get_lease, get_leader, get_shards, get_pools,
                           get_pool, healthz, readyz, metrics]
    app = Litestar(
        route_handlers=handlers,
        lifespan=[lifespan],
        state=State({"auth_guard": auth_guard, "settings": settings}),
        middleware=[batch_fast_path(lambda: app.state, settings.max_body_bytes)] if fast_path else [],
        exception_handlers={LeaseholdError: _leasehold_handler, HTTPException: _http_handler,
                            Exception: _internal_handler},
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Leasehold allocator", version="1.0.0", path="/schema"),
        debug=False,
    )
    document_problems(app)
    return app
