"""Both services as real processes for the hostile-input tests of this package (schema fuzzing,
the hostile-body corpus, header and slow-client limits): started once per package, with
authentication on, real Redis and real etcd, short HTTP head/body deadlines so the slow-client
tests stay short."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Pool
from leasehold.local.procs import Proc, RedisServer, free_port, wait_port
from leasehold.local.services import agent_command, allocator_command
from tests.integration.allocator.helpers import unique_prefix
from tests.integration.allocator.helpers import write_bundle as write_pools
from tests.integration.region_agent.conftest import NORTHSTAR, ROOT

TOKEN = secrets.token_urlsafe(24)
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
HEAD_TIMEOUT_MS = 1_000  # --http-header-timeout-ms / --http-body-timeout-ms of both processes
BODY_TIMEOUT_MS = 1_000
MAX_HEADER_BYTES = 16_384  # the defaults, passed explicitly so the tests state what they check
MAX_HEADERS = 100
HTTP_ARGS = ("--http-header-timeout-ms", str(HEAD_TIMEOUT_MS), "--http-body-timeout-ms", str(BODY_TIMEOUT_MS),
             "--http-max-header-bytes", str(MAX_HEADER_BYTES), "--http-max-headers", str(MAX_HEADERS))


@dataclass
class Service:
    name: str
    base: str
    port: int
    proc: Proc
    post_routes: dict[str, dict]  # path -> a valid body
    redis: RedisServer | None = None  # the agent's Redis

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def log(self) -> str:
        assert self.proc.log_path is not None
        return self.proc.log_path.read_text(errors="replace")


def _wait_ready(base: str, proc: Proc) -> None:
    for _ in range(600):
        assert proc.alive(), proc.tail()
        with contextlib.suppress(httpx.HTTPError):
            if all(httpx.get(base + p, timeout=2).status_code == 200 for p in ("/readyz", "/v1/health/store")):
                return  # ready, and its store healthy (the allocator knows its role)
        time.sleep(0.05)
    raise AssertionError(f"{proc.name} not ready:\n{proc.tail()}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER="fuzz-pepper-not-secret")
    return env


def _admit(rid: str) -> dict:
    return {"requestId": rid, "tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
            "routeGroup": "read", "method": "GET", "costHint": 1}


@pytest.fixture(scope="package")
def agent_service(tmp_path_factory) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("hostile-agent")
    redis_srv = RedisServer(work / "redis").start()
    port = free_port()
    proc = Proc(f"hostile-agent-{port}", agent_command(
        *HTTP_ARGS, redis_url=redis_srv.url, policy=NORTHSTAR, region="eu", host="127.0.0.1", port=port,
        policy_poll_ms=0, auth_disabled=False, gateway_tokens=[f"fuzz:{DIGEST}"], operator_tokens=[f"ops:{DIGEST}"],
        log_level="info"), work / "agent", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        release = {"requestId": "hostile-000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
                   "routeGroup": "export"}
        yield Service("agent", base, port, proc, {
            "/v1/admit": _admit("hostile-000001"), "/v1/admit/batch": {"requests": [_admit("hostile-000002")]},
            "/v1/release": release, "/v1/renew": release}, redis=redis_srv)
    finally:
        proc.stop()
        redis_srv.stop()


@pytest.fixture(scope="package")
def allocator_service(tmp_path_factory, etcd_cluster) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("hostile-allocator")
    bundle = write_pools(work / "pools.json", [Pool(id="p1", window_ms=60_000, limit=1_000_000, chunk_max=1000),
                                               Pool(id="p2", window_ms=1_000, limit=50, chunk_max=10, prefetch_ms=100)])
    port = free_port()
    proc = Proc(f"hostile-allocator-{port}", allocator_command(
        *HTTP_ARGS, etcd=etcd_cluster.endpoints, policy=bundle, node_id="fuzz-1", host="127.0.0.1", port=port,
        prefix=unique_prefix(), auth_disabled=False, region_tokens=[f"eu:{DIGEST}"], log_level="info"),
        work / "allocator", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        lease = {"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1", "want": 1}
        yield Service("allocator", base, port, proc, {
            "/v1/leases": lease, "/v1/leases/batch": {"requests": [{**lease, "leaseId": "hostile-lease-0002"}]},
            "/v1/leases/hostile-lease-0001/usage": {"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1",
                                                    "spent": 0},
            "/v1/usage/batch": {"reports": [{"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1",
                                             "spent": 0}]}})
    finally:
        proc.stop()


@pytest.fixture(params=["agent", "allocator"])
def service(request) -> Service:
    return request.getfixturevalue(f"{request.param}_service")


def rss_kib(pid: int) -> int:
    """Resident set size of a process (and its children, e.g. uvicorn workers), from /proc."""
    total = 0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for t in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (t / "children").read_text().split()]
    return out
