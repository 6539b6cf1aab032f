"""Tracing asked for but impossible refuses the start with one clear line (no traceback, exit 2),
and this installation can load the OTLP exporter at all: xds-protos ships an older copy of
``opentelemetry/proto/*``, and when pip installs it after opentelemetry-proto every service
started with ``--otlp-endpoint`` exits at once (make setup and the image reinstall
opentelemetry-proto last)."""

from __future__ import annotations

import sys

import pytest

from kernel import tracing
from leasehold.local.topology import DEFAULT_POLICY

EXPORTER = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"


def test_this_installation_loads_the_otlp_exporter():
    tracing.check("http://127.0.0.1:4317")  # raises TracingUnavailable with the cause and the fix


def test_no_endpoint_needs_no_exporter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, EXPORTER, None)  # an import of it fails
    tracing.check(None)
    tracing.check("")


@pytest.mark.parametrize("service", ["allocator", "region_agent"])
def test_a_service_refuses_to_start_without_its_exporter(service: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]):
    monkeypatch.setitem(sys.modules, EXPORTER, None)
    with pytest.raises(tracing.TracingUnavailable, match="opentelemetry-proto"):
        tracing.check("http://127.0.0.1:4317")
    if service == "allocator":
        from allocator.__main__ import main
        argv = ["--etcd", "127.0.0.1:2379", "--node-id", "a1", "--auth-disabled", "--policy", str(DEFAULT_POLICY)]
    else:
        from region_agent.__main__ import main
        argv = ["--redis-url", "redis://127.0.0.1:6379/0", "--region", "eu", "--auth-disabled",
                "--insecure-dev-pepper"]
    assert main([*argv, "--otlp-endpoint", "http://127.0.0.1:4317"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{service}: refusing to start: --otlp-endpoint: the OTLP exporter cannot be imported")
    assert "Traceback" not in err and "--force-reinstall opentelemetry-proto" in err
