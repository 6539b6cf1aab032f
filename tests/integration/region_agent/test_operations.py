"""Operations on the agent as a real process (docs/operations.md): one rate-limited log line per
Redis reachability change, and ``/v1/release`` bounded by the decision budget while Redis hangs."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from leasehold.local.procs import RedisServer
from tests.support.agent import admit_body, agent_process
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration

REACHABILITY = ("redis unreachable", "redis reachable again")


def transition_lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text(errors="replace").splitlines() if any(m in ln for m in REACHABILITY)]


def test_one_log_line_per_redis_reachability_change(tmp_path: Path, policy_file: Path):
    redis_srv = RedisServer(tmp_path / "redis").start()
    args = ("--log-level", "info", "--redis-log-interval-ms", "3000", "--breaker-open-ms", "200",
            "--decision-budget-ms", "200", "--redis-socket-timeout-ms", "200")
    try:
        with agent_process(tmp_path / "agent", redis_srv.url, policy_file, *args) as (base, proc), \
                httpx.Client(base_url=base, timeout=5) as c:
            assert proc.log_path is not None
            admit = [0]

            def traffic(n: int = 20) -> None:
                for _ in range(n):
                    admit[0] += 1
                    assert c.post("/v1/admit", json=admit_body(f"ops-{admit[0]:06d}")).status_code == 200

            traffic()
            assert transition_lines(proc.log_path) == []  # healthy: nothing said
            redis_srv.stop()
            traffic(40)  # failures open the breaker; decisions degrade
            assert wait_until(lambda: len(transition_lines(proc.log_path)) >= 1, within_s=20)
            (down,) = transition_lines(proc.log_path)
            assert "redis unreachable" in down and "WARNING" in down and len(down) < 300
            # flapping: three quick outages within the rate-limit interval cost no line each
            def breaker_is(state: int) -> bool:
                traffic(2)
                return f'leasehold_agent_breaker_state{{shard="default"}} {state}.0' in c.get("/metrics").text

            for _ in range(3):
                redis_srv.start()
                assert wait_until(lambda: breaker_is(0), within_s=20)  # closed again
                redis_srv.stop()
                assert wait_until(lambda: breaker_is(2), within_s=20)  # and open again
            redis_srv.start()

            def recovered() -> bool:
                traffic(5)
                lines = transition_lines(proc.log_path)
                return "reachable again" in lines[-1]
            assert wait_until(recovered, within_s=20)
            lines = transition_lines(proc.log_path)
            assert len(lines) <= 3, lines  # the first outage, at most one interim line, the recovery
            assert "redis reachable again" in lines[-1] and "INFO" in lines[-1]
            assert "more changes since the last line" in lines[-1]
            traffic()
            time.sleep(0.5)
            assert transition_lines(proc.log_path) == lines  # steady again: silent
    finally:
        redis_srv.stop()


def test_release_respects_the_decision_budget_while_redis_hangs(tmp_path: Path, policy_file: Path):
    """A hung Redis (SIGSTOP: connections open, no replies) used to hold /v1/release for the full
    socket timeout; now it answers 503 (retriable) within the decision budget, like admissions."""
    redis_srv = RedisServer(tmp_path / "redis").start()
    args = ("--decision-budget-ms", "100", "--redis-socket-timeout-ms", "8000")
    release = {"requestId": "hang-000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-1"},
               "routeGroup": "export"}
    try:
        with agent_process(tmp_path / "agent", redis_srv.url, policy_file, *args) as (base, _), \
                httpx.Client(base_url=base, timeout=3) as c:
            assert c.post("/v1/admit", json=admit_body("hang-000001", pid="U-1", route="export")).json()["allowed"]
            assert c.post("/v1/release", json=release).json()["released"] == 1
            assert redis_srv.proc is not None
            os.kill(redis_srv.proc.pid, signal.SIGSTOP)
            try:
                for path in ("/v1/release", "/v1/renew", "/v1/release"):  # well before the 8 s socket
                    resp = c.post(path, json=release)  # timeout (the client gives up after 3 s)
                    assert resp.status_code == 503, resp.text
                    assert resp.headers["content-type"].startswith("application/problem+json")
                    assert resp.json()["retriable"] is True
            finally:
                os.kill(redis_srv.proc.pid, signal.SIGCONT)
            assert wait_until(lambda: c.post("/v1/release", json=release).status_code == 200, within_s=20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            if redis_srv.proc is not None:
                os.kill(redis_srv.proc.pid, signal.SIGCONT)
        redis_srv.stop()
