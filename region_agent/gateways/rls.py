"""Envoy's rate limit service (``envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit``)
served by the region agent on its own port (``--rls-port``), in the agent's event loop
(``grpc.aio``), with the standard gRPC health service beside it.

Thin adapter: the request's bytes -> :func:`.mapping.rls_call` -> the agent's one decision path
(:meth:`region_agent.gateways.Gateways.decide`, the same as ``/v1/admit``) ->
:func:`.answer.rls_answer`'s answer -> its bytes out (:class:`.rls_wire.AnswerWire`: written without a
protobuf message, what protobuf parses as :func:`to_proto`'s message). The generated messages come
from the ``xds-protos`` package; the health service from ``grpcio-health-checking``.

The questions of a call are a pure function of its bytes and the agent's names, but for the
request ids minted for descriptors that name none (:class:`.mapping.CallQuestions`). Envoy sends
the same bytes for the same caller and route each time, so the door remembers a call's questions
by its bytes (:class:`CallMemo`, bounded) and asks them again with fresh minted ids: the protobuf
parse, the descriptor mapping and the validating convert (about 7 us of the loop thread's time per
call) happen once per distinct call. Bytes that are not a ``RateLimitRequest`` are
``INVALID_ARGUMENT`` (reason ``undecodable``); a refused call is never remembered.

gRPC status codes of a call (what Envoy does with each is in ``region_agent/README.md``):

* ``OK`` with ``overall_code`` ``OK`` or ``OVER_LIMIT`` — every decision, including degraded
  ones: a ``closed`` rule without its store is ``OVER_LIMIT`` with the 503 answer's headers and
  body and dynamic metadata ``leasehold_status: 503``; ``local_bounded`` rules answer from the
  local allowance, ``open`` rules ``OK``. A request id that already has a decision record for
  another question (a replayed id) is ``OVER_LIMIT`` too, with the 409 problem and metadata
  ``leasehold_status: 409`` — never an error, which ``failure_mode_deny: false`` would let
  through. ``UNKNOWN`` is never sent as ``overall_code`` (Envoy's client treats it as ``OK``;
  its documented meaning is "not known").
* ``INVALID_ARGUMENT`` — not a question Leasehold can answer (bytes that do not parse, another
  domain, an unmapped descriptor key, a limit override, a bad value or cost), counted by reason.
* ``UNAUTHENTICATED`` — missing or wrong ``authorization: Bearer <gateway token>`` metadata; the
  caller's address is logged (a WARNING, at most one per address a minute: :func:`log_refused`).
* ``RESOURCE_EXHAUSTED`` — ``--rls-max-concurrent-rpcs`` calls are being decided and RLQS streams
  are open (:class:`RateLimitServicer`'s slots); also grpc's own, for a message or metadata too large.
* ``UNAVAILABLE`` — the agent is still starting.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

from kernel import tracing
from kernel.auth import TokenTable, authenticate
from kernel.caches import BoundedMemo
from kernel.errors import LeaseholdError, Unauthorized, Unavailable, ValidationFailed
from kernel.ratelog import ThrottleFilter

from ..decision.plan import Snapshot
from ..models import AdmitRequest, Decision
from ..service.prometheus_internals import add_observations
from .answer import rls_answer
from .call_group import CallGroup
from .mapping import BadQuestion, CallQuestions, Descriptor, Names, rls_call
from .metrics import LATENCY_BUCKETS, GatewayMetrics
from .refused_callers import RefusedCallers
from .rls_wire import AnswerWire

log = logging.getLogger(__name__)

SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
HEALTH = "grpc.health.v1.Health"
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"  # grpc's own records of the calls it serves (UnsentAnswers)
Response = rls_pb2.RateLimitResponse
OK, OVER_LIMIT = Response.OK, Response.OVER_LIMIT
UNITS = {name: Response.RateLimit.Unit.Value(name) for name in Response.RateLimit.Unit.keys()}
OUTCOME_OF_STATUS = {200: "ok", 503: "unavailable_503", 409: "conflict_409"}  # else over_limit
OUTCOMES = ("ok", "over_limit", "unavailable_503", "conflict_409", "invalid", "unauthenticated", "not_ready",
            "exhausted", "error")


LATENCY_BOUNDS = (*LATENCY_BUCKETS, float("inf"))  # leasehold_agent_rls_seconds' upper bounds, +Inf last
MEMO_CALLS = 20_000  # calls remembered by their bytes (CallMemo)
MEMO_BYTES = 1_024  # a call of more bytes than this is not remembered: the memo's memory stays bounded (~20 MB)
_parse = rls_pb2.RateLimitRequest.FromString


class CallMemo:
    """The questions of the calls seen, by the call's bytes (module doc): at most ``MEMO_CALLS``
    calls of at most ``MEMO_BYTES`` bytes each; a full memo starts again empty. What a call is
    asked for depends only on its bytes and ``names``, which the servicer keeps for its life.

    Only calls whose every request id is minted are remembered: a call that names its request id
    (the shipped Envoy files send ``x-request-id`` for idempotent routes) has bytes of its own
    each time, and remembering it would only churn the memo; it is built afresh, as a replay is."""

    __slots__ = ("_known", "names")

    def __init__(self, names: Names, max_calls: int = MEMO_CALLS):
        self.names = names
        self._known: BoundedMemo[bytes, CallQuestions] = BoundedMemo(max_calls)

    def __len__(self) -> int:
        """Calls remembered."""
        return len(self._known)

    def questions(self, raw: bytes) -> list[AdmitRequest]:
        """The questions of the call ``raw``; raises :class:`.mapping.BadQuestion`."""
        asked = self.asked(raw)
        return asked if isinstance(asked, list) else [asked]

    def asked(self, raw: bytes) -> AdmitRequest | list[AdmitRequest]:
        """:meth:`questions`, but a call of one question (one descriptor: the common call) as
        that question alone, without a list (:meth:`.mapping.CallQuestions.asked`)."""
        known = self._known.get(raw)
        if known is not None:
            return known.asked()
        try:
            request = _parse(raw)
        except DecodeError:
            raise BadQuestion("undecodable", "the message is not a RateLimitRequest") from None
        call = rls_call(self.names, request.domain, descriptors_of(request, self.names), request.hits_addend)
        if len(call.minted) == len(call.questions) and len(raw) <= MEMO_BYTES:
            self._known.put(raw, call)  # a call that names a request id is new each time: never asked again
        return call.questions[0] if len(call.questions) == 1 else list(call.questions)


def descriptors_of(request: rls_pb2.RateLimitRequest, names: Names) -> list[Descriptor]:
    """The call's descriptors, protobuf-free, read only as far as :func:`.mapping.rls_call` can
    accept: one descriptor past ``rls_max_descriptors`` and one entry past the mapped keys are
    enough for it to refuse the call with the same reason (too many descriptors; an entry past
    every mapped key is unknown or a duplicate). A call of a few MB of descriptors and entries is
    then refused for the cost of its parse, not of turning every entry into Python objects (about
    a second of the loop thread's time for 4 MB)."""
    entries = len(names.rls_fields) + 1
    return [Descriptor(tuple([(e.key, e.value) for e in d.entries[:entries]]),
                       d.hits_addend.value if d.HasField("hits_addend") else None, d.HasField("limit"))
            for d in request.descriptors[:names.rls_max_descriptors + 1]]


def to_proto(decisions: list[Decision], questions: list[AdmitRequest], snap: Snapshot) -> tuple[Response, int]:
    """The call's answer as a protobuf message and the HTTP status /v1/admit would answer. The
    servicer sends the same answer's bytes written directly (:class:`.rls_wire.AnswerWire`); this is
    what they are compared with (tests/unit/region_agent/gateways/test_rls_wire.py)."""
    # an address-window denial of an authenticated question is the pre-auth stage's: anonymous too
    ans = rls_answer(decisions, snap, [q.principal.type == "anonymous" or q.auth_failed or d.denied_scope == "ip"
                                         for q, d in zip(questions, decisions, strict=True)])
    resp = Response(overall_code=OVER_LIMIT if ans.over_limit else OK, raw_body=ans.body)
    for s in ans.statuses:
        st = resp.statuses.add(code=OVER_LIMIT if s.over_limit else OK, limit_remaining=s.remaining)
        if s.limit_name is not None:
            st.current_limit.name = s.limit_name
            st.current_limit.requests_per_unit = s.requests_per_unit
            st.current_limit.unit = UNITS[s.unit]
        if s.reset_ms:
            st.duration_until_reset.FromMilliseconds(s.reset_ms)
    for k, v in ans.headers.items():
        resp.response_headers_to_add.add(key=k, value=v)
    if ans.metadata:
        resp.dynamic_metadata.update({f"leasehold_{k}": v for k, v in ans.metadata.items()})
    return resp, ans.http_status


class _Exhausted(Exception):
    """Every slot of the port is taken (:class:`RateLimitServicer`)."""

    detail = "too many RLS calls and RLQS streams at once (--rls-max-concurrent-rpcs)"


class RateLimitServicer:
    """``ShouldRateLimit`` of the request's bytes (:meth:`handlers` registers it with grpcio
    without a request deserializer: :class:`CallMemo` parses a call it does not know).

    The port's slots (``--rls-max-concurrent-rpcs``) are counted here, not by grpc: an
    authenticated call takes one while it is decided, an open RLQS stream one for its life
    (``streams_open``). grpc's own count took a slot for every call on the port from its headers
    until its answer was taken, whatever its method and credential: streams that never sent
    their message, health ``Watch`` streams and answers a client never read took them all
    (docs/decisions/0068-the-grpc-ports-slots-are-the-agents.md)."""

    def __init__(self, *, names: Names, decide: Callable[..., Awaitable[list[Decision]]],
                 snapshot_of: Callable[[], Snapshot], gateways: TokenTable | None, metrics: GatewayMetrics,
                 group_linger_s: float = 0.0, group_size: int = 32, max_slots: int = 4_096,
                 streams_open: Callable[[], int] = lambda: 0,
                 decide_one: Callable[..., Awaitable[Decision]] | None = None):
        self.names = names
        self.max_slots = max_slots
        self.streams_open = streams_open  # RLQS streams open (each holds a slot)
        self.calls = CallMemo(names)
        self.wire = AnswerWire()  # the answers' bytes (.rls_wire)
        # calls that arrive together are decided together (.call_group); linger 0: each call alone
        self.group = CallGroup(self._decide_group, group_linger_s, group_size, on_group=metrics.rls_group_calls.observe)
        self.decide = decide
        # a call of one question, alone: the admission's own single decision (Admission.decide_one,
        # no lists); None: ``decide`` of a list of one
        self.decide_one = decide_one if decide_one is not None else self._one_of_list
        self.snapshot_of = snapshot_of
        self.gateways = gateways  # None: --auth-disabled
        self.metrics = metrics
        # the label children, bound once (a labels() lookup per call was a tenth of the door's work)
        self._calls = {o: metrics.rls_calls.labels(o) for o in OUTCOMES}
        self._ok_descriptors = metrics.rls_descriptors.labels("OK")
        self._over_descriptors = metrics.rls_descriptors.labels("OVER_LIMIT")
        # what answered calls count, kept in plain Python and moved into those metrics when the
        # registry is collected (GatewayMetrics.add_flush): a locked prometheus update per count
        # and the latency's observe were about 1.5 us of every call
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._descriptors = [0, 0]  # OK, OVER_LIMIT
        self._latency = [0.0] + [0] * len(LATENCY_BOUNDS)  # seconds in total, observations per bucket
        metrics.add_flush(self.flush)

    def flush(self) -> None:
        """Move the calls counted since the last collection into the registry (module doc of
        .metrics; a histogram takes its bucket counts at once: region_agent.service.prometheus_internals)."""
        counts = self._counts
        for outcome, n in counts.items():
            if n:
                self._calls[outcome].inc(n)
                counts[outcome] = 0
        (ok, over), self._descriptors = self._descriptors, [0, 0]
        if ok:
            self._ok_descriptors.inc(ok)
        if over:
            self._over_descriptors.inc(over)
        latency = self._latency
        if any(latency[1:]):
            self._latency = [0.0] + [0] * len(LATENCY_BOUNDS)
            add_observations(self.metrics.rls_latency, latency[0], latency[1:])

    def _decide_group(self, questions: list[AdmitRequest]) -> Awaitable[list[Decision]]:
        """The questions of a group of calls (.call_group), decided at once. No trace context:
        calls are grouped only while tracing is off (each traced call is its own decision span)."""
        return self.decide(questions, door="rls", decoded=True)

    async def _one_of_list(self, question: AdmitRequest, **kw: Any) -> Decision:
        (d,) = await self.decide([question], **kw)
        return d

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The service's method handlers for a grpc server: requests arrive as bytes and answers
        leave as bytes (no deserializer, no serializer: :class:`CallMemo`, :class:`.rls_wire.AnswerWire`)."""
        return {"ShouldRateLimit": grpc.unary_unary_rpc_method_handler(
            self.ShouldRateLimit, request_deserializer=None, response_serializer=None)}

    async def ShouldRateLimit(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The serialised ``RateLimitResponse`` of the call ``request`` (its bytes)."""
        started = time.perf_counter()
        m = self.metrics
        code, detail, outcome = grpc.StatusCode.OK, "", "error"
        group = self.group
        joins = group.enter()
        try:
            # the call's metadata, read only when something needs it: the gateway token, a trace's context
            traced = tracing.ENABLED
            metadata = (context.invocation_metadata() or ()) if self.gateways is not None or traced else ()
            if self.gateways is not None:
                authenticate(self.gateways, metadata)  # pairs: two tokens are refused
            if group.in_flight + self.streams_open() > self.max_slots:  # this call included
                raise _Exhausted
            asked = self.calls.asked(request)
            if not isinstance(asked, list):  # one descriptor, the common call: one question, no lists
                if joins and not traced:  # other calls in flight: decided with those arriving with it
                    (d,) = await group.decide([asked])
                else:  # decoded: the question was built by msgspec's validating convert (mapping.question)
                    d = await self.decide_one(asked, door="rls", carrier=metadata, decoded=True)
                resp, status, over = self.wire.answer_one(d, asked, self.snapshot_of())
                self._descriptors[over] += 1  # (over: 0 or 1)
            else:
                if joins and not traced:
                    decisions = await group.decide(asked)
                else:
                    decisions = await self.decide(asked, door="rls", carrier=metadata, decoded=True)
                resp, status, over = self.wire.answer(decisions, asked, self.snapshot_of())
                counted = self._descriptors
                counted[0] += len(decisions) - over
                counted[1] += over
            outcome = OUTCOME_OF_STATUS.get(status, "over_limit")
            return resp
        except Unauthorized as e:
            code, detail, outcome = grpc.StatusCode.UNAUTHENTICATED, e.detail, "unauthenticated"
            log_refused(context.peer())
        except _Exhausted:
            code, detail, outcome = grpc.StatusCode.RESOURCE_EXHAUSTED, _Exhausted.detail, "exhausted"
        except BadQuestion as e:
            code, detail, outcome = grpc.StatusCode.INVALID_ARGUMENT, e.detail, "invalid"
            m.rls_invalid.labels(e.reason).inc()
        except ValidationFailed as e:  # a value the engine refused (e.g. not an IP address)
            code, detail, outcome = grpc.StatusCode.INVALID_ARGUMENT, e.detail, "invalid"
            m.rls_invalid.labels("bad_value").inc()
        except Unavailable as e:
            code, detail, outcome = grpc.StatusCode.UNAVAILABLE, e.detail, "not_ready"
        except LeaseholdError as e:
            code, detail = grpc.StatusCode.INTERNAL, e.detail
        except Exception:
            log.exception("RLS call failed")
            code, detail = grpc.StatusCode.INTERNAL, "internal error"
        finally:
            group.leave()
            self._counts[outcome] += 1
            seconds = time.perf_counter() - started
            latency = self._latency
            latency[0] += seconds
            latency[1 + bisect_left(LATENCY_BOUNDS, seconds)] += 1  # the bucket observe() would count it in
        await context.abort(code, detail)
        raise AssertionError("unreachable")  # context.abort raises


refused_callers = RefusedCallers(log)  # a call without a valid gateway token, in this door's log


def peer_address(peer: str | None) -> str:
    """The address of grpc's peer string (``ipv4:10.1.2.3:50412``, ``ipv6:[fd00::1]:50412``,
    ``unix:/path``) without the port: one caller's connections share it."""
    if not peer:
        return "unknown"
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        rest = rest.rsplit(":", 1)[0].strip("[]")
    return rest or peer


def log_refused(peer: str | None, what: str = "RLS call") -> None:
    """The WARNING naming the address of a caller refused for its gateway token (at most one per
    address and minute; the next says how many were not written)."""
    refused_callers.log(peer_address(peer), what)


class UnsentAnswers(logging.Filter):
    """grpc's record of a call whose answer could not be sent — its client reset the stream or
    closed the connection first, e.g. one that never read its answers — is an ERROR with
    grpc's traceback, once per such call. It is the client's doing, not the agent's: one short
    INFO line, without the traceback, at most one per ``interval_s`` (kernel.ratelog)."""

    TEMPLATE = "ExecuteBatchError raised in core by servicer method"

    def __init__(self, interval_s: float = 10.0):
        super().__init__()
        self.throttle = ThrottleFilter(interval_s=interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(self.TEMPLATE)):
            return True
        method = record.getMessage()[len(self.TEMPLATE):].strip()
        record.msg, record.args = "a gRPC call ended before its answer was sent (the client went away) %s", (method,)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.INFO, "INFO"
        return self.throttle.filter(record)


def _quiet_unsent_answers() -> None:
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, UnsentAnswers) for f in logger.filters):
        logger.addFilter(UnsentAnswers())


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS for the RLS port (``--rls-tls-cert-file``, ``--rls-tls-key-file``); with
    ``--rls-tls-client-ca-file`` every client must present a certificate signed by that CA."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    ca = read(client_ca_file) if client_ca_file else None
    return grpc.ssl_server_credentials([(read(key_file), read(cert_file))], root_certificates=ca,
                                       require_client_auth=ca is not None)


class RlsServer:
    """The gRPC server: RLS v3 (and, with ``also``, RLQS) plus ``grpc.health.v1.Health`` (SERVING while the agent answers
    decisions — degraded ones included, so a Redis outage is answered by the per-rule fail
    modes rather than by Envoy's failure_mode_deny; NOT_SERVING while it shuts down)."""

    def __init__(self, servicer: RateLimitServicer, *, host: str, port: int, streams_per_connection: int,
                 max_connections: int = 128, keepalive_ms: int = 0, tls: grpc.ServerCredentials | None = None,
                 also: tuple[tuple[str, Callable[[grpc.aio.Server], None]], ...] = ()):
        # no maximum_concurrent_rpcs: the slots are the servicer's (RateLimitServicer), never taken by
        # a call that is not authenticated, not yet a question, or answered and not read
        options: list[tuple[str, int]] = [
            ("grpc.so_reuseport", 1),  # one port, several uvicorn workers
            ("grpc.max_concurrent_streams", streams_per_connection),  # what one connection can hold
            # how many connections the port holds: grpc's core closes one accepted beyond them at once
            # (docs/decisions/0071-every-door-holds-a-stated-number-of-connections.md)
            ("grpc.max_allowed_incoming_connections", max_connections),
            # a client may ping every half second whatever is sent: the shipped envoy-rlqs.yaml pings
            # every second to close a stalled connection (rlqs_funding.renewal_ttl), and grpc's default
            # (5 minutes between pings when the server sends nothing) would end its connection
            ("grpc.http2.min_ping_interval_without_data_ms", 500),
            ("grpc.keepalive_permit_without_calls", 1)]  # pings on a connection without calls too
        if keepalive_ms:  # a peer that answers no ping (gone, or reading nothing) loses its connection
            options += [("grpc.keepalive_time_ms", keepalive_ms), ("grpc.keepalive_timeout_ms", keepalive_ms),
                        ("grpc.http2.ping_timeout_ms", keepalive_ms), ("grpc.http2.max_pings_without_data", 0)]
        self.server = grpc.aio.server(options=options)
        _quiet_unsent_answers()
        handlers = servicer.handlers()  # as generated stubs register a service: generic and registered
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.server.add_registered_method_handlers(SERVICE, handlers)
        self.services = ("", SERVICE, *(name for name, _ in also))  # what the health service reports
        for _, add in also:  # more services on the same port (region_agent.gateways.rlqs)
            add(self.server)
        self.health = health.aio.HealthServicer()
        # Check only: a Watch stream never ends and needs no credential (Envoy's and Kubernetes'
        # gRPC health checks call Check)
        check = {"Check": grpc.unary_unary_rpc_method_handler(
            self.health.Check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString)}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HEALTH, check),))
        address = f"{host}:{port}"
        self.port = self.server.add_secure_port(address, tls) if tls else self.server.add_insecure_port(address)

    async def start(self) -> RlsServer:
        await self.server.start()
        for name in self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


__all__ = ["CallMemo", "RateLimitServicer", "RlsServer", "descriptors_of", "server_credentials", "to_proto"]
