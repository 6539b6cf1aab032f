"""The agent's RLS port over mutual TLS (``--rls-tls-cert-file``, ``--rls-tls-key-file``,
``--rls-tls-client-ca-file``): a real gRPC client with and without the right certificates, and
a real Envoy whose ``leasehold_rls`` cluster carries the ``transport_socket`` block documented in
region_agent/README.md ("RLS over TLS"), taken from the README as it stands."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasehold.local.gateways import PLACEHOLDER, Envoy, render
from leasehold.local.procs import LOOPBACK, TlsFiles, free_port, make_tls

from .conftest import ROOT, Stack, assert_p_read, identity

pytestmark = pytest.mark.e2e

D = ratelimit_pb2.RateLimitDescriptor


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    d = tmp_path_factory.mktemp("rls-pki")
    return make_tls(d / "agent"), make_tls(d / "rogue")


@pytest.fixture(scope="module")
def extra_agent_args(pki) -> tuple[str, ...]:
    tls, _ = pki
    return ("--rls-tls-cert-file", str(tls.cert), "--rls-tls-key-file", str(tls.key),
            "--rls-tls-client-ca-file", str(tls.ca))


def read(p: Path | None) -> bytes:
    assert p is not None
    return p.read_bytes()


def health(stack: Stack, creds: grpc.ChannelCredentials | None) -> int:
    target = f"{LOOPBACK}:{stack.rls_port}"
    options = (("grpc.ssl_target_name_override", "localhost"),)
    with (grpc.secure_channel(target, creds, options) if creds else grpc.insecure_channel(target)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_grpc_client_needs_the_ca_and_a_client_certificate(stack: Stack, pki):
    tls, rogue = pki
    good = grpc.ssl_channel_credentials(read(tls.ca), read(tls.client_key), read(tls.client_cert))
    assert health(stack, good) == health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(f"{LOOPBACK}:{stack.rls_port}", good,
                             (("grpc.ssl_target_name_override", "localhost"),)) as ch:
        resp = rls_pb2_grpc.RateLimitServiceStub(ch).ShouldRateLimit(
            rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[
                D.Entry(key="tenant", value="atlas"), D.Entry(key="user", value="U-90"),
                D.Entry(key="route_group", value="read")])]),
            metadata=(("authorization", f"Bearer {stack.token}"),), timeout=10)
        assert resp.overall_code == rls_pb2.RateLimitResponse.OK
    refused = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(read(tls.ca)),
        "a client certificate of another CA": grpc.ssl_channel_credentials(read(tls.ca), read(rogue.client_key),
                                                                           read(rogue.client_cert)),
        "a CA that did not sign the agent's certificate": grpc.ssl_channel_credentials(
            read(rogue.ca), read(tls.client_key), read(tls.client_cert)),
    }
    for why, creds in refused.items():
        with pytest.raises(grpc.RpcError) as e:
            health(stack, creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why


def documented_transport_socket() -> str:
    readme = (ROOT / "region_agent" / "README.md").read_text()
    m = re.search(r"<!-- rls-tls-envoy -->\n```yaml\n(.*?)```\n<!-- /rls-tls-envoy -->", readme, re.DOTALL)
    assert m, "region_agent/README.md lost its RLS-over-TLS Envoy block"
    return m.group(1)


@pytest.fixture(scope="module")
def tls_envoy(stack: Stack, pki) -> Iterator[Envoy]:
    tls, _ = pki
    port, admin = free_port(), free_port()
    config = yaml.safe_load(render("envoy-rls.yaml", **stack.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port,
                                                                      ENVOY_ADMIN_PORT=admin)))
    values = {"AGENT_TLS_NAME": "localhost", "RLS_CA": tls.ca, "RLS_CLIENT_CERT": tls.client_cert,
              "RLS_CLIENT_KEY": tls.client_key}
    block = yaml.safe_load(PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), documented_transport_socket()))
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "leasehold_rls"]
    cluster.update(block)
    e = Envoy("envoy-rls-tls", yaml.safe_dump(config, sort_keys=False), stack.workdir / "envoy-rls-tls", port,
              admin).start()
    yield e
    e.stop()


def test_p_read_through_envoy_over_mutual_tls(stack: Stack, tls_envoy: Envoy):
    stack.full_frozen_bucket("U-91")
    before = stack.metric("leasehold_agent_rls_requests_total")
    with httpx.Client(base_url=tls_envoy.url, timeout=10) as c:
        responses = [c.get("/catalog", headers=identity("U-91")) for _ in range(21)]
    assert_p_read(responses)
    assert stack.metric("leasehold_agent_rls_requests_total") - before == 21  # every answer came over TLS
    stats = tls_envoy.stats("cluster.leasehold_rls.")
    assert stats.get("cluster.leasehold_rls.ssl.handshake", 0) >= 1, stats
    assert stats.get("cluster.leasehold_rls.ssl.connection_error", 0) == 0, stats
