"""OpenTelemetry tracing for both services: off unless ``--otlp-endpoint`` names an OTLP/gRPC
collector; then spans go there in batches (the SDK's ``BatchSpanProcessor``), sampled by
``--trace-sample-ratio`` for new traces while a caller's sampled flag is followed (parent-based).

W3C trace context (``traceparent`` / ``tracestate``) is taken from what a gateway sends (HTTP
headers of ``/v1/admit`` and ``/v1/authz``, the metadata of an RLS call) and sent on to the
allocator with every lease request, so one trace crosses gateway -> agent -> allocator.

What a client sends there is untrusted: a malformed ``traceparent`` (another version's rules, ids
of zeros, upper case) is ignored and the decision starts a new trace; so is a ``traceparent`` sent
twice (W3C trace context: a request with two is not continued). Several ``tracestate`` fields are
one list, in order (RFC 9110 field combination); one past 8,192 characters or 32 members, or with a
malformed member, is dropped whole. The opentelemetry package writes a WARNING for each such
``tracestate`` (naming the member): those lines are throttled to one per kind per
``LIBRARY_LOG_INTERVAL_S`` with the count of those not written, so a client cannot flood the log.

The opentelemetry packages are used through this module only. While tracing is off, callers
test :data:`ENABLED` first and pay nothing else on the decision path.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from . import logs
from .ratelog import ThrottleFilter

log = logging.getLogger(__name__)
ENABLED = False
_PROPAGATOR = TraceContextTextMapPropagator()
_HEADERS = ("traceparent", "tracestate")
_provider: Any = None
_exporter: Any = None
SHUTDOWN_S = 2.0  # what a process's exit waits for buffered spans at most
# a string attribute is cut to this many characters: a client's path (the allocator's url.path
# is set before the request is authenticated) would otherwise be kept up to the 16 KiB head limit
MAX_ATTRIBUTE_CHARS = 256
# the opentelemetry loggers that write a line per malformed trace context a client sent
CLIENT_INPUT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext")
LIBRARY_LOG_INTERVAL_S = 10.0

__all__ = ["ENABLED", "SpanKind", "TracingUnavailable", "carrier_of", "check", "context_of", "current_context", "inject", "setup", "shutdown",
           "span", "tracer"]


class TracingUnavailable(RuntimeError):
    """Tracing was asked for (``--otlp-endpoint``) but the OTLP exporter cannot be loaded: the
    service refuses to start with this message rather than run without the traces asked for."""


def _exporter_class() -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:  # xds-protos ships an older copy of opentelemetry/proto/*
        raise TracingUnavailable(
            f"--otlp-endpoint: the OTLP exporter cannot be imported ({e}); if xds-protos was installed after "
            "opentelemetry-proto, it replaced that package's files: run pip install --no-deps --force-reinstall "
            "opentelemetry-proto (make setup and the image do)") from None
    return OTLPSpanExporter


def check(endpoint: str | None) -> None:
    """At start, before serving: with an ``endpoint``, raise :class:`TracingUnavailable` if the
    exporter :func:`setup` will need cannot be loaded (each service's ``main`` prints it)."""
    if endpoint:
        _exporter_class()


def setup(service: str, endpoint: str | None, sample_ratio: float = 1.0, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process when ``endpoint`` (or a test's ``exporter``) is given."""
    global ENABLED, _provider, _exporter
    if not endpoint and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from .build_info import build_info

    version, commit = build_info()
    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.version": version,
                                                        "leasehold.commit": commit}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
                              span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS))
    if exporter is None:
        OTLPSpanExporter = _exporter_class()  # noqa: N806 - a class
        insecure = endpoint.startswith("http://") if endpoint else True
        _exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        provider.add_span_processor(BatchSpanProcessor(_exporter, schedule_delay_millis=500))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    throttle = ThrottleFilter(interval_s=LIBRARY_LOG_INTERVAL_S)
    for name in CLIENT_INPUT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ThrottleFilter) for f in logger.filters):
            logger.addFilter(throttle)
    _provider = provider
    ENABLED = True
    logs.set_trace_ids(_current_ids)
    log.info("tracing on: OTLP to %s, sampling %.3g of new traces", endpoint or "a test exporter", sample_ratio)
    return True


def shutdown(timeout_s: float = SHUTDOWN_S) -> None:
    """At a process's exit: what is buffered gets ``timeout_s`` to reach the collector, then the
    exporter is shut (its retries end) and the rest is dropped. The SDK's flush ignores its
    timeout and retries each batch for up to 10 s: with the collector unreachable and a full
    queue, an agent took over 30 s to exit after SIGTERM."""
    if _provider is None:
        return
    flushing = threading.Thread(target=_provider.force_flush, name="leasehold-trace-flush", daemon=True)
    flushing.start()
    flushing.join(timeout_s)
    with contextlib.suppress(Exception):
        if _exporter is not None:
            _exporter.shutdown()
        _provider.shutdown()


def tracer() -> Any:
    return trace.get_tracer("leasehold")


def carrier_of(pairs: Iterable[tuple[Any, Any]]) -> dict[str, list[str]]:
    """The trace headers among ASGI header pairs (bytes) or gRPC metadata (str): every value of
    each, in the order sent."""
    out: dict[str, list[str]] = {}
    for k, v in pairs:
        name = k.decode("latin-1").lower() if isinstance(k, bytes) else str(k).lower()
        if name in _HEADERS:
            out.setdefault(name, []).append(v.decode("latin-1") if isinstance(v, bytes) else str(v))
    return out


def context_of(pairs: Iterable[tuple[Any, Any]]) -> Any:
    """The caller's trace context from headers or metadata: None when it sent no ``traceparent``
    or more than one (module doc)."""
    carrier = carrier_of(pairs)
    if len(carrier.get("traceparent", ())) != 1:
        return None
    return _PROPAGATOR.extract(carrier)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    _PROPAGATOR.inject(headers)
    return headers


def current_context() -> Any:
    """The current span's context (to link or parent work done later, elsewhere)."""
    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, parent: Any = None, links: Iterable[Any] = (),
         attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """A span made current for the block. ``parent``: a context from :func:`context_of`, or a
    span context from :func:`current_context`; ``links``: span contexts."""
    if parent is not None and not isinstance(parent, otel_context.Context):
        parent = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=attributes,
                                        links=[Link(c) for c in links if c is not None]) as s:
        yield s


def _current_ids() -> tuple[str, str] | None:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
