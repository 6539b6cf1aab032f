"""Hostile input: both services' OpenAPI schemas fuzzed with schemathesis against real servers
(uvicorn subprocesses, real Redis, real etcd, authentication on). Positive and negative
(schema-violating) cases; every answer must be a non-5xx whose body matches the schema
(problem+json for errors). A bounded profile: >= 2,000 requests per service."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from kernel.bundle import Pool
from leasehold.procs import Proc, RedisServer, free_port, wait_port
from tests.integration.agent.conftest import NORTHSTAR, ROOT
from tests.integration.allocator.helpers import unique_prefix
from tests.integration.allocator.helpers import write_bundle as write_pools

MIN_REQUESTS = 2_000
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
TOKEN = secrets.token_urlsafe(24)
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()


def _wait_ready(base: str, proc: Proc) -> None:
    for _ in range(600):
        assert proc.alive(), proc.tail()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{proc.name} not ready:\n{proc.tail()}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER="fuzz-pepper-not-secret")
    return env


@pytest.fixture(scope="module")
def agent_base(tmp_path_factory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("fuzz-agent")
    redis_srv = RedisServer(work / "redis").start()
    port = free_port()
    proc = Proc(f"fuzz-agent-{port}", [
        sys.executable, "-m", "region_agent", "--redis-url", redis_srv.url, "--policy", str(NORTHSTAR),
        "--region", "eu", "--host", "127.0.0.1", "--port", str(port), "--policy-poll-ms", "0",
        "--auth-disabled", "false", "--gateway-tokens", f"fuzz:{DIGEST}", "--operator-tokens", f"ops:{DIGEST}",
        "--log-level", "warning"], work / "agent", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        yield base
    finally:
        proc.stop()
        redis_srv.stop()


@pytest.fixture(scope="module")
def allocator_base(tmp_path_factory, etcd_cluster) -> Iterator[str]:
    work = tmp_path_factory.mktemp("fuzz-allocator")
    bundle = write_pools(work / "pools.json", [Pool(id="p1", window_ms=60_000, limit=1_000_000, chunk_max=1000),
                                               Pool(id="p2", window_ms=1_000, limit=50, chunk_max=10, prefetch_ms=100)])
    port = free_port()
    proc = Proc(f"fuzz-allocator-{port}", [
        sys.executable, "-m", "allocator", "--etcd", ",".join(etcd_cluster.endpoints), "--policy", str(bundle),
        "--node-id", "fuzz-1", "--host", "127.0.0.1", "--port", str(port), "--prefix", unique_prefix(),
        "--auth-disabled", "false", "--region-tokens", f"eu:{DIGEST}", "--log-level", "warning"],
        work / "allocator", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        yield base
    finally:
        proc.stop()


def fuzz(base: str, per_operation: int) -> Counter:
    """Every operation, positive then negative cases; returns status counts."""
    schema = schemathesis.openapi.from_url(base + "/schema/openapi.json")
    statuses: Counter = Counter()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, timeout=10) as _client:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=per_operation, deadline=None, database=None, derandomize=True,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                def run(case) -> None:
                    response = case.call(base_url=base, headers=headers)
                    statuses[response.status_code] += 1
                    case.validate_response(response, checks=CHECKS, headers=headers)
                try:
                    run()
                except Unsatisfiable:  # no way to violate the schema of an operation without inputs
                    assert mode is GenerationMode.NEGATIVE
    return statuses


def test_agent_schema_fuzz(agent_base):
    statuses = fuzz(agent_base, per_operation=350)
    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and (statuses[400] + statuses[422]) > 0


def test_allocator_schema_fuzz(allocator_base):
    statuses = fuzz(allocator_base, per_operation=290)
    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    assert not any(s >= 500 for s in statuses), statuses
    assert statuses[200] > 0 and (statuses[400] + statuses[422]) > 0
