"""The RLS budget experiment's model servers (bench.rls_budget serve), each a real process on a
free loopback port: every server model answers concurrent ShouldRateLimit calls with OK; a bad
argument is refused as a usage error."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from bench.harness import _env
from bench.rls_budget import MODELS
from leasehold.local.procs import Proc, free_port, wait_port


async def _calls(port: int, n: int) -> list[int]:
    D = ratelimit_pb2.RateLimitDescriptor
    req = rls_pb2.RateLimitRequest(domain="leasehold", descriptors=[D(entries=[D.Entry(key="user", value="u")])])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rls_pb2_grpc.RateLimitServiceStub(ch)
        answers = await asyncio.gather(*(stub.ShouldRateLimit(req, timeout=10) for _ in range(n)))
    return [a.overall_code for a in answers]


@pytest.mark.parametrize("model", MODELS)
def test_each_model_answers_concurrent_calls_ok(tmp_path: Path, model: str) -> None:
    port = free_port()
    p = Proc(f"rls-budget-{model}", [sys.executable, "-m", "bench.rls_budget", "serve", "--port", str(port),
                                     "--work-us", "50", "--model", model], tmp_path, env=_env()).start()
    try:
        wait_port(port, proc=p.popen, timeout=30)
        codes = asyncio.run(_calls(port, 24))
    finally:
        p.stop()
    assert codes == [rls_pb2.RateLimitResponse.OK] * 24


def test_a_negative_work_value_is_refused_without_a_traceback(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bench.rls_budget", "serve", "--port", "1", "--work-us", "-1"],
                         capture_output=True, text=True, env=_env(), timeout=30)
    assert out.returncode == 2
    assert "--work-us must be >= 0" in out.stderr and "Traceback" not in out.stderr
