"""The region agent's Litestar application.

``create_app(settings, pepper=...)`` builds the app; the lifespan connects to Redis, loads
the scripts (retried in the background until they load), and polls the policy file."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from litestar import Litestar, MediaType, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.openapi import OpenAPIConfig
from litestar.params import Body
from litestar.types import Scope
from prometheus_client import CONTENT_TYPE_LATEST

from kernel import tracing
from kernel.bundle import Bundle
from kernel.errors import LeaseholdError, Unavailable
from kernel.http_errors import exception_handlers, problem_response
from kernel.jsonbody import StrictJSONRequest
from kernel.openapi_enums import inline_enums
from kernel.openapi_problems import document_problems
from kernel.signing import TrustedKeys

from ..decision.admission import Admission, http_conflict, is_conflict
from ..decision.engine import DecisionEngine
from ..decision.fallback import LocalAllowances
from ..decision.httpmap import RetryJitter
from ..decision.keys import KeyBuilder
from ..decision.negcache import NegativeCache
from ..decision.telemetry import DecisionTelemetry
from ..decision.version_check import VersionCheck
from ..gateways import Gateways
from ..gateways.authz import authz
from ..leasing.warmup import warmup_balances
from ..leasing.window_clock import AllocatorClock
from ..models import (
    MAX_BATCH_BODY_BYTES,
    MAX_BODY_BYTES,
    AdmitBatch,
    AdmitRequest,
    BatchDecisions,
    Decision,
    DeniedScope,
    PolicyInfo,
    ReleaseRequest,
    ReleaseResult,
    RenewRequest,
    RenewResult,
)
from ..store import scripts as sc
from ..store.breaker import STATE_NAMES
from . import store_health
from .audit import BypassAudit, make_sink
from .auth import AgentAuth, agent_guard
from .decision_log import DecisionLog
from .fastpath import DirectAdmit, admit_fast_path
from .fastpath import install as install_fast_path
from .metrics import AgentMetrics
from .policy import PolicyHolder, ReloadResult
from .settings import AgentSettings

log = logging.getLogger(__name__)
VALIDATION_STATUS = 422  # a body or parameter that does not fit the schema (the allocator answers 400)


@dataclass
class AgentState:
    settings: AgentSettings
    holder: PolicyHolder
    metrics: AgentMetrics
    keys: KeyBuilder
    engine: DecisionEngine | None = None
    store: Any = None
    leases: Any = None  # LeaseManager when --allocator-urls is set
    policy_watch: Any = None  # kernel.watch.PolicyWatcher when --policy-etcd is set
    auth: Any = None  # region_agent.service.auth.AgentAuth; None only with --auth-disabled
    key_cap: Any = None  # region_agent.decision.preauth.NewKeyCap; None when --anon-new-keys-per-source 0
    version_check: Any = None  # region_agent.decision.version_check.VersionCheck (policyEpoch in requests)
    audit: Any = None  # region_agent.service.audit.BypassAudit
    gateways: Any = None  # region_agent.gateways.Gateways: RLS gRPC server and /v1/authz
    admission: Any = None  # region_agent.decision.admission.Admission: what every door asks
    tasks: list[asyncio.Task] = field(default_factory=list)
    shutting_down: bool = False  # from SIGTERM (or the lifespan's end): /readyz answers 503


def _dependencies(state: AgentState) -> dict[str, Provide]:
    """What handlers are given by Litestar's dependency injection: the agent's ``agent`` state
    and its decision ``engine`` (Unavailable until the lifespan built it)."""

    def agent() -> AgentState:
        return state

    def engine() -> DecisionEngine:
        if state.engine is None:
            raise Unavailable("agent is starting")
        return state.engine

    return {"agent": Provide(agent, sync_to_thread=False), "engine": Provide(engine, sync_to_thread=False)}


# ---------------------------------------------------------------------------------- handlers
@post("/v1/admit", status_code=200, request_max_body_size=MAX_BODY_BYTES,
      summary="Admission decision for one request")
async def admit(agent: NamedDependency[AgentState], data: Annotated[AdmitRequest, Body(title="AdmitRequest")],
                scope: Scope) -> Decision:
    d = await agent.admission.decide_one(data, door="http", carrier=scope.get("headers", ()), decoded=True)
    if is_conflict(d):
        raise http_conflict(d)  # the one door that answers a conflict with its own status (409)
    return d


@post("/v1/admit/batch", status_code=200, request_max_body_size=MAX_BATCH_BODY_BYTES,
      summary="Admission decisions for many requests, in order, one pipeline per shard")
async def admit_batch(agent: NamedDependency[AgentState], data: Annotated[AdmitBatch, Body(title="AdmitBatch")],
                      scope: Scope) -> BatchDecisions:
    return await decide_batch(agent, data.requests, scope.get("headers", ()))


async def decide_batch(st: AgentState, reqs: list[AdmitRequest], carrier: Any = ()) -> BatchDecisions:
    """The batch route's answer for decoded ``reqs`` (the handler's and region_agent.service.fastpath's):
    every item's decision, a conflict included (``httpStatus: 409``); ``carrier``: the request's
    headers (the gateway's trace context)."""
    return BatchDecisions(decisions=await st.admission.decide(reqs, door="http", carrier=carrier, decoded=True))


@post("/v1/release", status_code=200, request_max_body_size=MAX_BODY_BYTES,
      summary="Release the concurrency slot(s) of a request (idempotent)")
async def release(engine: NamedDependency[DecisionEngine],
                  data: Annotated[ReleaseRequest, Body(title="ReleaseRequest")]) -> ReleaseResult:
    released, gates = await engine.release(data)
    return ReleaseResult(request_id=data.request_id, released=released, gates=gates)


@post("/v1/renew", status_code=200, request_max_body_size=MAX_BODY_BYTES,
      summary="Heartbeat: extend the request's live concurrency slot(s) by concurrencyTtlMs (idempotent)")
async def renew(engine: NamedDependency[DecisionEngine], data: Annotated[RenewRequest, Body(title="RenewRequest")]) -> RenewResult:
    renewed, gates = await engine.renew(data)
    return RenewResult(request_id=data.request_id, renewed=renewed, gates=gates)


@get("/v1/policy", summary="The policy bundle in force")
async def policy(agent: NamedDependency[AgentState]) -> PolicyInfo:
    b: Bundle = agent.holder.bundle
    return PolicyInfo(bundle_version=b.bundle_version, checksum=b.checksum, published_at=b.published_at,
                      rule_ids=[r.id for r in b.rules], pool_ids=[p.id for p in b.pools])


@get("/v1/leases", summary="This agent's pool balances, leases held, epochs and expiry")
async def leases_view(agent: NamedDependency[AgentState]) -> Response:
    st = agent
    if st.leases is None:
        return Response({"region": st.settings.region, "allocator": None, "balances": []})
    return Response({"region": st.settings.region, "allocator": st.leases.client.urls,
                     "pendingReports": st.leases.reports_pending, "balances": st.leases.view()})


@get("/v1/rlqs", summary="Quota assignments this agent holds out to Envoys (RLQS), per bucket")
async def rlqs_view(agent: NamedDependency[AgentState]) -> Response:
    service = agent.gateways.rlqs if agent.gateways is not None else None
    if service is None:
        return Response({"region": agent.settings.region, "serving": False, "streams": [], "buckets": []})
    return Response({"region": agent.settings.region, "serving": True, **service.view()})


@get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz", summary="Readiness: this agent can answer decisions (not the store's health)")
async def readyz(agent: NamedDependency[AgentState]) -> Response:
    """Ready = the agent answers decisions: its bundle is loaded, the first lease of every pool
    balance was answered (bounded by the allocator client's deadline) and it is not shutting down.
    A Redis outage does not make it unready: it then answers by each rule's fail mode, which is the
    point of the degradation design (taking every agent of a region out of its Service would hand
    the decision to the gateways' failure mode instead). The store's health: ``/v1/health/store``."""
    st = agent
    problems = []
    if st.holder.bundle is None:
        problems.append("no policy bundle")
    if st.engine is None:
        problems.append("starting")
    if st.shutting_down:
        problems.append("shutting down")
    if st.leases is not None and st.leases.warming:
        problems.append("first leases not answered yet")
    if st.metrics.store_health.evicting and not st.settings.allow_evicting_store:
        problems.append("the store may evict keys (maxmemory-policy " + ", ".join(
            sorted(set(st.metrics.store_health.evicting.values()))) + ")")
    if problems:
        return problem_response(Unavailable("not ready: " + ", ".join(problems)), instance="/readyz")
    b = st.holder.bundle
    return Response({"status": "ready", "policyVersion": b.bundle_version, "region": st.settings.region})


@get("/v1/health/store", summary="The store's health: Redis reachable, scripts loaded (for alerts, not a probe)")
async def store_health_view(agent: NamedDependency[AgentState]) -> Response:
    """200 while this agent's Redis answers a PING, else 503 (its decisions then follow the rules'
    fail modes). For monitoring and runbooks; never a readiness or liveness probe."""
    st = agent
    if st.store is None:
        return problem_response(Unavailable("store not connected yet"), instance="/v1/health/store")
    if getattr(st.store, "cluster", False):  # a Redis Cluster: per primary (region_agent/store/cluster.py)
        shards = await st.store.health()
        up = sum(s["reachable"] for s in shards)
        reachable = bool(shards) and up == len(shards)
        body = {"store": "reachable" if reachable else "degraded" if up else "unreachable",
                "scriptsLoaded": bool(st.store.scripts_loaded), "breaker": "per shard", "shards": shards}
        if not reachable:
            return problem_response(Unavailable(f"{len(shards) - up} of {len(shards)} Redis Cluster primaries "
                                                "unreachable: their tenants' decisions follow the rules' fail modes",
                                                extra=body), instance="/v1/health/store")
        return Response(body)
    reachable = await st.store.ping()
    breaker = getattr(st.store, "breaker", None)
    body = {"store": "reachable" if reachable else "unreachable",
            "scriptsLoaded": bool(getattr(st.store, "scripts_loaded", False)),
            "breaker": STATE_NAMES.get(breaker.state, "unknown") if breaker is not None else "none"}
    if not reachable:
        return problem_response(Unavailable("store unreachable: decisions follow the rules' fail modes",
                                            extra=body), instance="/v1/health/store")
    return Response(body)


@get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics(agent: NamedDependency[AgentState]) -> Response:
    return Response(agent.metrics.render(), media_type=CONTENT_TYPE_LATEST)  # several workers: all of them


# ---------------------------------------------------------------------------------- app
def create_app(settings: AgentSettings, *, pepper: bytes, holder: PolicyHolder | None = None,
               metrics_obj: AgentMetrics | None = None, store_factory=None,
               install_signal_handlers: bool = False, fast_path: bool = True,
               freeze_heap: bool = False) -> Litestar:
    """Build the app. ``store_factory(settings, metrics) -> RedisNode`` is for the lifespan;
    the default connects to ``settings.redis_url``. ``freeze_heap``: the lifespan ends its start-up
    with :func:`kernel.httpserver.freeze_startup_heap` (the agent process; not an app a test
    builds among others)."""
    m = metrics_obj or AgentMetrics()
    tracing.setup("leasehold-agent", settings.otlp_endpoint, settings.trace_sample_ratio)  # off without an endpoint

    def on_reload(res: ReloadResult) -> None:
        m.policy_reloads.labels(res.outcome).inc()
        if res.outcome == "accepted":
            m.bundle_version.set(res.version)
            log.info("policy bundle %s accepted", res.version)
        else:
            log.warning("policy reload refused (%s): %s", res.outcome, res.detail)

    jitter = RetryJitter(settings.retry_jitter_pct, settings.retry_jitter_max_ms, settings.retry_jitter_seed.encode(),
                         settings.retry_jitter_min_ms)
    if holder is None:
        holder = PolicyHolder.load(settings.policy, on_reload=on_reload,
                                   trusted=TrustedKeys.from_files(settings.policy_public_keys), jitter=jitter)
    else:
        holder._on_reload = holder._on_reload or on_reload
        holder.set_jitter(jitter)
    m.bundle_version.set(holder.bundle.bundle_version)
    m.connections.follow(settings.http_max_connections, settings.rls_port, settings.rls_max_connections)
    holder.region, holder.agent_id = settings.region, settings.agent_id  # who a canary slice names

    def on_canary(outcome: str, version: int) -> None:
        if outcome == "set":
            m.policy_candidate.set(version)
        else:
            m.policy_canary.labels(outcome).inc()

    holder.on_canary = on_canary
    m.policy_age.set_function(lambda: time.monotonic() - holder.checked_at)  # etcd: the watcher's age
    audit = BypassAudit(m, make_sink(settings.audit_log))
    state = AgentState(settings=settings, holder=holder, metrics=m, keys=KeyBuilder(pepper),
                       auth=AgentAuth.from_settings(settings), key_cap=_key_cap(settings))
    state.version_check = VersionCheck(m, refresh=lambda: _refresh_policy(state))
    state.audit = audit
    state.admission = Admission(lambda: state)
    state.gateways = Gateways(settings, state_of=lambda: state, admission=state.admission, registry=m.registry)
    m.add_flush(state.gateways.metrics.flush)  # the doors' counts kept outside the registry (several workers too)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        factory = store_factory or default_store_factory
        state.store = factory(settings, m)
        if tracing.ENABLED:  # a span per script call (region_agent.service.tracing)
            from .tracing import TracedStore
            state.store = TracedStore(state.store)
        if hasattr(state.store, "start"):
            state.store.start()
        await _first_load(state.store)  # refused credentials or ACL: no start (StoreAccessRefused)
        if hasattr(state.store, "info_readers"):  # an evicting store silently resets enforcement
            try:
                await store_health.check_eviction_policy(state.store, m.store_health,
                                                         allowed=settings.allow_evicting_store)
            except store_health.EvictingStore as e:
                log.critical("%s", e)
                await state.store.close()
                raise
        if settings.policy_etcd:  # its credentials, its role's read, TLS refused: no start (0065)
            refusal = await policy_etcd_refusal(settings)
            if refusal is not None:
                log.critical("refusing to start: %s", refusal)
                await state.store.close()
                raise PolicyEtcdRefused(refusal)
        clock = AllocatorClock(unknown_offset_ms=settings.allocator_clock_uncertainty_ms)
        state.leases = _lease_manager(settings, state.store, m, clock)
        telemetry = DecisionTelemetry(m, audit=audit,
                                      shard_of=state.store.shard_of if getattr(state.store, "cluster", False)
                                      else None)
        state.engine = DecisionEngine(get_snapshot=lambda: state.holder.snapshot, snapshot_for=state.holder.snapshot_for,
                              keys=state.keys, store=state.store,
                              metrics=m, fallback=LocalAllowances(settings.fallback_max_keys),
                              budget_ms=settings.decision_budget_ms, cold_wait_ms=settings.cold_lease_wait_ms,
                              leases=state.leases,
                              negative=NegativeCache(cap_ms=settings.negative_cache_ms), telemetry=telemetry,
                              allocator_clock=clock, decision_log=DecisionLog.from_settings(settings, state.keys, m))
        if state.leases is not None:
            state.leases.start()
            if settings.lease_warmup:
                state.leases.warm_up(warmup_balances(state.holder.bundle, settings.region))
        if settings.policy_etcd:
            state.policy_watch = await _start_policy_watch(settings, state)
        if hasattr(state.store, "warm"):  # the pipelines' connections, open before the first burst
            await state.store.warm(settings.pipelines_in_flight + 2)
        state.tasks.append(asyncio.create_task(_background(state)))
        if settings.store_health_ms and hasattr(state.store, "info_readers"):
            state.tasks.append(asyncio.create_task(store_health.run(state.store, m.store_health,
                                                                    settings.store_health_ms)))
        await state.gateways.start()  # the RLS gRPC server, when --rls-port is set
        if freeze_heap:
            from kernel.httpserver import freeze_startup_heap
            freeze_startup_heap()
        loop = asyncio.get_running_loop()
        undo_termination = None
        if install_signal_handlers:
            loop.add_signal_handler(signal.SIGHUP, state.holder.reload)
            from kernel.httpserver import on_termination

            def terminating() -> None:  # SIGTERM: unready, and no new leases (before uvicorn drains)
                state.shutting_down = True
                if state.leases is not None:
                    state.leases.begin_shutdown()
            undo_termination = on_termination(terminating)
        try:
            yield
        finally:
            state.shutting_down = True
            if undo_termination is not None:
                undo_termination()
            await state.gateways.stop()
            if install_signal_handlers:
                loop.remove_signal_handler(signal.SIGHUP)
            if state.policy_watch is not None:
                await state.policy_watch.stop()
                await state.policy_watch.store.store.close()
            for t in state.tasks:
                t.cancel()
            for t in state.tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            audit.flush(force=True)
            if state.engine is not None and state.engine.decision_log is not None:
                state.engine.decision_log.close()
            if state.leases is not None:  # close the leases held and report them (returned to the pool now)
                await state.leases.shutdown(settings.shutdown_report_ms / 1000)
                await state.leases.client.aclose()
            if state.engine is not None:  # the approximate counters' last reconciliation
                await state.engine.approx.close()
            await state.store.close()
            m.close()
            tracing.shutdown()

    app = Litestar(
        route_handlers=[admit, admit_batch, release, renew, policy, leases_view, rlqs_view, healthz, readyz,
                        store_health_view, metrics, authz],
        guards=[agent_guard],
        dependencies=_dependencies(state),
        lifespan=[lifespan],
        # logging stays as __main__ set it up: Litestar's default config would route every record
        # through a queue listener thread, and what is queued when SIGTERM ends the process (the
        # shutdown report line) is lost
        logging_config=None,
        exception_handlers=exception_handlers(validation_status=VALIDATION_STATUS),  # kernel.http_errors
        openapi_config=OpenAPIConfig(title="Leasehold region agent", version="1.0.0", path="/schema"),
        request_max_body_size=MAX_BATCH_BODY_BYTES,
        request_class=StrictJSONRequest,  # kernel.jsonbody: application/json only, strict typed decoding
        debug=False,
    )
    app.state.direct_routes = None
    if fast_path:  # region_agent.service.fastpath: in front of the router, and the protocol's direct routes
        install_fast_path(app, admit_fast_path(lambda: state, MAX_BODY_BYTES, decide_batch, MAX_BATCH_BODY_BYTES))
        app.state.direct_routes = {
            b"/v1/admit": DirectAdmit(lambda: state, MAX_BODY_BYTES, "/v1/admit"),
            b"/v1/admit/batch": DirectAdmit(lambda: state, MAX_BATCH_BODY_BYTES, "/v1/admit/batch", decide_batch),
        }
    app.state.agent = state
    document_problems(app)
    inline_enums(app, DeniedScope)  # deniedScope documented as the inline string enum it always was
    return app


def _lease_manager(settings: AgentSettings, store: Any, m: AgentMetrics, clock: AllocatorClock):
    """The region's lease manager, when allocator URLs are configured."""
    if not settings.allocator_urls:
        return None
    from ..leasing.client import AllocatorClient
    from ..leasing.manager import LeaseManager
    from ..leasing.redis_balance import RedisBalanceStore

    token = None
    if settings.allocator_token_file:
        with open(settings.allocator_token_file) as f:
            token = f.read().strip() or None
    client = AllocatorClient(settings.allocator_urls, token=token,
                             attempt_timeout_s=settings.allocator_timeout_ms / 1000,
                             deadline_s=settings.allocator_deadline_ms / 1000)
    balances = RedisBalanceStore(store.client, store.scripts)
    return LeaseManager(region=settings.region, client=client, store=balances, metrics=m,
                        tick_ms=settings.lease_tick_ms, clock=clock,
                        lag_s=lambda: store.lag.lag_s(time.monotonic()))


def _key_cap(settings: AgentSettings):
    if not settings.anon_new_keys_per_source:
        return None
    from ..decision.preauth import NewKeyCap
    return NewKeyCap(per_source=settings.anon_new_keys_per_source, window_ms=settings.anon_new_keys_window_ms,
                     max_sources=settings.anon_sources_max, v4_coarse=settings.anon_source_v4_prefix,
                     v6_coarse=settings.anon_source_v6_prefix)


async def _start_policy_watch(settings: AgentSettings, state: AgentState):
    """Follow the policy key in etcd: one bounded first read, then watch + periodic re-read."""
    from .policy_watch import age_gauge, make_watcher
    from .settings import policy_etcd_tls, resolve_secret

    password = resolve_secret(settings.policy_etcd_password_file, "POLICY_ETCD_PASSWORD")
    w = make_watcher(state.holder, settings.policy_etcd or "", prefix=settings.policy_etcd_prefix,
                     reread_ms=settings.policy_etcd_reread_ms, user=settings.policy_etcd_user, password=password,
                     tls=policy_etcd_tls(settings))
    age_gauge(state.metrics, w)
    state.metrics.etcd_refused.follow(w.store.store)  # leasehold_agent_etcd_refused{cause}
    with contextlib.suppress(Exception):
        await asyncio.wait_for(w.refresh(), 3.0)
    w.start()
    return w


def default_store_factory(settings: AgentSettings, m: AgentMetrics):
    """One Redis, a Redis Cluster (a node and breaker per primary) or a Sentinel's primary."""
    from ..store.factory import make_store

    return make_store(settings, m)


class StoreAccessRefused(RuntimeError):
    """At start, the regional Redis answered but refused the agent's credentials, or its ACL user
    may not run what the scripts need: the agent does not start (an agent that started would
    answer every decision degraded until an operator noticed)."""


async def _try_access(store: Any) -> None:
    """Load the scripts and run one read-only script (region_agent.store.scripts.Scripts.check_access).
    Refused credentials or a missing permission: :class:`StoreAccessRefused`; anything else the
    store raised (unreachable, full) as it came."""
    try:
        await store.load()
        scripts, client = getattr(store, "scripts", None), getattr(store, "client", None)
        if isinstance(scripts, sc.Scripts) and client is not None:
            await scripts.check_access(client)
    except sc.StoreRefused as e:
        if e.cause == "oom":  # the store is full: that passes (and is logged by the breaker when it lasts)
            raise
        what = {"auth": "refused the agent's Redis credentials (WRONGPASS/NOAUTH): check the user and password "
                        "of --redis-url (or LEASEHOLD_AGENT_REDIS_PASSWORD)",
                "tls": "presented a TLS certificate that did not verify (certificate verify failed): give the "
                       "CA that signed it with --redis-ca-file, and a host name the certificate names",
                }.get(e.cause, "refused a command or key the agent needs (NOPERM): its ACL user needs EVALSHA, EVAL, "
                               "SCRIPT LOAD, TIME, INFO and PING and the commands of the scripts on the rl:* keys, "
                               "and SELECT for a database other than 0 (docs/deployment.md)")
        raise StoreAccessRefused(f"the regional Redis {what}") from None


async def _first_load(store: Any) -> None:
    """Load the scripts and try the agent's access once (:func:`_try_access`). A store that does
    not answer now is not an error: the agent starts degraded and the background task loads the
    scripts once it answers. A store that answers with a refusal of the credentials or of a
    permission is a deployment error: :class:`StoreAccessRefused`, with one critical line (no
    credential in it)."""
    try:
        await _try_access(store)
    except StoreAccessRefused as e:
        log.critical("refusing to start: %s", e)
        await store.close()
        raise
    except LeaseholdError as e:  # not answering now: start degraded, the background task loads later
        log.warning("Redis scripts not loaded at start (%s): decisions degrade per rule failMode until "
                    "the store answers", e.detail)


class PolicyEtcdRefused(RuntimeError):
    """At start, the etcd of ``--policy-etcd`` answered but refused the agent's credentials, its
    role's read of the policy keys or the TLS handshake: the agent does not start (one that started
    would run on its start bundle, answer ready, and go stale at the bundle's ``maxAgeMs``)."""


async def policy_etcd_refusal(settings: AgentSettings) -> str | None:
    """Why the agent must not start on its policy etcd (:func:`.policy_watch.etcd_refusal`), asked
    once before the server starts (``python -m region_agent`` refuses with one line and exit 2) and
    again by the lifespan for an app made in process. None also when etcd does not answer now."""
    from .policy_watch import etcd_refusal, etcd_store
    from .settings import policy_etcd_tls, resolve_secret

    store = etcd_store(settings.policy_etcd or "", user=settings.policy_etcd_user,
                       password=resolve_secret(settings.policy_etcd_password_file, "POLICY_ETCD_PASSWORD"),
                       tls=policy_etcd_tls(settings), report_refusals=False)
    try:
        return await etcd_refusal(store, prefix=settings.policy_etcd_prefix, user=settings.policy_etcd_user,
                                  trusted=TrustedKeys.from_files(settings.policy_public_keys))
    finally:
        await store.close()


async def store_refusal(settings: AgentSettings) -> str | None:
    """Why the agent must not start on its Redis — refused credentials or permission
    (:func:`_try_access`), an evicting ``maxmemory-policy`` without ``--allow-evicting-store`` —
    asked once before the server starts, so that ``python -m region_agent`` refuses with one line
    and exit code 2 like its other refusals (the lifespan asks again, for an app made in
    process). None when there is nothing to refuse, or when the store does not answer now."""
    store = default_store_factory(settings, AgentMetrics())
    try:
        try:
            await _try_access(store)
        except StoreAccessRefused as e:
            return str(e)
        except LeaseholdError:  # unreachable or full now: the start goes on (the lifespan says so)
            return None
        if settings.allow_evicting_store or not hasattr(store, "info_readers"):
            return None
        try:
            _, answered = await store_health.read_info(store, 2.0)
        except Exception:  # the topology is not known: the lifespan's check and the poll see to it
            return None
        bad = store_health.evicting(answered)
        return store_health.eviction_refusal(bad) if bad else None
    finally:
        await store.close()


async def _background(state: AgentState) -> None:
    """Poll the policy file's mtime; keep trying to load the scripts until they are loaded."""
    interval = (state.settings.policy_poll_ms or 1000) / 1000
    while True:
        await asyncio.sleep(interval)
        if state.settings.policy_poll_ms:
            try:
                state.holder.poll()
            except Exception:
                log.exception("policy poll failed")
        if state.store is not None and not state.store.scripts_loaded:
            with contextlib.suppress(LeaseholdError):
                await state.store.load()
        if state.audit is not None:
            state.audit.flush()
        if state.metrics.multiprocess:  # several workers: this one's counts reach the shared files
            state.metrics.flush()


def _refresh_policy(state: AgentState) -> None:
    """A request named a newer policyEpoch than the bundle in force: look at the source now
    (an etcd read off the request path, or a look at the bundle file's mtime)."""
    if state.policy_watch is not None:
        _REFRESHES.add(task := asyncio.get_running_loop().create_task(state.policy_watch.refresh()))
        task.add_done_callback(_REFRESHES.discard)
        return
    try:
        state.holder.poll()
    except Exception:
        log.exception("policy poll failed")


_REFRESHES: set[asyncio.Task] = set()  # in-flight refreshes (a reference keeps them alive)


__all__ = ["AgentState", "MediaType", "create_app", "problem_response"]
