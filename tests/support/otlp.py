"""An OTLP/gRPC trace receiver for tests that run real processes with tracing on (the services'
``--otlp-endpoint``, Envoy's OpenTelemetry tracer): it keeps every exported span with the
``service.name`` of its resource."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from leasehold.local.procs import LOOPBACK, free_port


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Every exported span with its service name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, sp) for sp in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def find(self, service: str, name: str | None = None, trace_id: bytes | None = None) -> list:
        """Spans of ``service`` (named ``name``, in trace ``trace_id`` when given)."""
        with self.lock:
            return [sp for svc, sp in self.spans if svc == service and (name is None or sp.name == name)
                    and (trace_id is None or sp.trace_id == trace_id)]

    def in_trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        """(service, span) of every span of one trace."""
        with self.lock:
            return [(svc, sp) for svc, sp in self.spans if sp.trace_id == trace_id]


def attrs(span) -> dict:
    """A span's attributes as a dict."""
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@contextmanager
def receiving() -> Iterator[tuple[Receiver, int]]:
    """A receiver serving on a free loopback port: (receiver, port)."""
    port = free_port()
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    server.add_insecure_port(f"{LOOPBACK}:{port}")
    server.start()
    try:
        yield rec, port
    finally:
        server.stop(1)
