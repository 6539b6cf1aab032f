"""Agent fixtures against the real Redis fixtures: the Litestar app in-process (requests run one
at a time through the test client's portal) or as real uvicorn processes (true concurrency)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis, RedisCluster

from leasehold.local.procs import Proc, free_port, wait_port
from leasehold.local.services import agent_command
from region_agent.service.app import create_app
from region_agent.service.settings import AgentSettings

# the sample bundle: other test modules import these names from here
from tests.support.policies import NORTHSTAR, northstar, write_bundle  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
PEPPER = b"test-pepper-not-secret"


def make_settings(redis_url: str, policy: Path, **kw) -> AgentSettings:
    # these tests rewrite stored state to simulate time, which an in-process negative cache cannot
    # see; the negative cache has its own tests (test_negative_cache.py)
    kw.setdefault("negative_cache_ms", 0)
    # these tests check the worked numbers' exact Retry-After values (max(1, ceil(ms / 1000))): no jitter
    # (its spread: tests/unit/region_agent/decision/test_retry_jitter.py; with it on: the gateway e2e tests)
    kw.setdefault("retry_jitter_max_ms", 0)
    kw.setdefault("auth_disabled", True)  # gateway/operator authentication: tests/integration/security
    return AgentSettings(redis_url=redis_url, policy=str(policy), region="eu", policy_poll_ms=0,
                         decision_budget_ms=kw.pop("decision_budget_ms", 2000), **kw)


@pytest.fixture
async def agent(redis_url: str, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    app = create_app(make_settings(redis_url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


@pytest.fixture
async def cluster_agent(redis_cluster_url: str, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    url = redis_cluster_url.replace("redis://", "redis+cluster://")
    app = create_app(make_settings(url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


class Topology(NamedTuple):
    name: str  # "standalone" | "cluster"
    url: str  # for the test's own client
    agent_url: str  # what the agent is given


@pytest.fixture(params=["standalone", "cluster"])
def topology(request: pytest.FixtureRequest) -> Topology:
    """The behaviour suites (test_worked_numbers.py, test_algorithms_http.py) run on a standalone
    Redis and on a 3-master Redis Cluster: the agent's HTTP path, not only the scripts."""
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        return Topology("cluster", url, url.replace("redis://", "redis+cluster://"))
    url = request.getfixturevalue("redis_url")
    return Topology("standalone", url, url)


@pytest.fixture
async def store_client(topology: Topology) -> AsyncIterator[Redis | RedisCluster]:
    """The test's own client of the topology's Redis (to read and set stored state)."""
    client = RedisCluster.from_url(topology.url) if topology.name == "cluster" else Redis.from_url(topology.url)
    yield client
    await client.aclose()


def admit_body(request_id: str, *, tenant: str | None = "atlas", ptype: str = "user", pid: str = "U-17",
               route: str = "read", cost: int = 1, api_key: str | None = "K1") -> dict:
    body: dict = {"requestId": request_id, "principal": {"type": ptype, "id": pid}, "routeGroup": route,
                  "method": "GET", "costHint": cost}
    if api_key is not None:
        body["principal"]["apiKeyId"] = api_key
    if tenant is not None:
        body["tenantId"] = tenant
    return body


async def admit_json(agent, rid: str, **kw) -> dict:
    """POST /v1/admit through the test client; the answer must be a 200 decision."""
    resp = await agent.post("/v1/admit", json=admit_body(rid, **kw))
    assert resp.status_code == 200, resp.text
    return resp.json()


# --- direct state access for the worked numbers ------------------------------------------------
def user_key(tenant: str, user: str, route: str) -> str:
    from region_agent.decision.keys import KeyBuilder

    return f"rl:v3:{{t:{tenant}}}:u:{KeyBuilder(PEPPER).h(tenant, 'u', user)}:{route}"


def tenant_key(tenant: str, route: str = "all") -> str:
    return f"rl:v3:{{t:{tenant}}}:tenant:{tenant}:{route}"


FROZEN_AHEAD_MS = 3_600_000  # a bucket whose ts is ahead of the store clock gets no refill (clock-backwards clamp)


async def store_now_ms(r) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def set_bucket(r, key: str, tokens: int, *, age_ms: int | None = None) -> None:
    """Write a token bucket: frozen (no refill) when ``age_ms`` is None, else last written ``age_ms`` ago."""
    now = await store_now_ms(r)
    ts = now + FROZEN_AHEAD_MS if age_ms is None else now - age_ms
    await r.hset(key, mapping={"tokens": tokens, "ts": ts})
    await r.pexpire(key, 600_000)


async def bucket_tokens(r, key: str) -> int:
    return int(await r.hget(key, "tokens"))


# --- the agent as a real uvicorn subprocess (true concurrency: the in-process test client
# --- serialises requests through its blocking portal) --------------------------------------------
@contextlib.contextmanager
def agent_process(workdir: Path, redis_url: str, policy: Path, *extra: str,
                  ready_path: str | None = None) -> Iterator[tuple[str, Proc]]:
    """Waits for ``/readyz`` and the store's health (Redis reached, scripts loaded), or for
    ``ready_path`` alone (``/healthz`` for an agent whose Redis is down on purpose)."""
    paths = (ready_path,) if ready_path else ("/readyz", "/v1/health/store")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
    proc = Proc(f"agent-{port}", agent_command(
        *(() if "--negative-cache-ms" in extra else ("--negative-cache-ms", "0")),
        *(() if "--retry-jitter-max-ms" in extra else ("--retry-jitter-max-ms", "0")),  # the exact hints (make_settings)
        *(() if {"--auth-disabled", "--no-auth-disabled"} & set(extra) else ("--auth-disabled",)), *extra,
        redis_url=redis_url, policy=policy, region="eu", host="127.0.0.1", port=port, policy_poll_ms=0,
        log_level="warning"), workdir, env=env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        for _ in range(300):  # bounded wait for readiness (scripts loaded)
            with contextlib.suppress(httpx.HTTPError):
                if all(httpx.get(base + p, timeout=2).status_code == 200 for p in paths):
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError("agent never became ready:\n" + proc.tail())
        yield base, proc
    finally:
        proc.stop()
