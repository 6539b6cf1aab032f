"""Connections the server closed while they were idle — Redis restarted on the same port, or
``CLIENT KILL`` (what a server-side idle ``timeout`` does too) — on a real redis-server: the next
pipeline and the next decision are decided normally, with nothing ambiguous, degraded or counted
against the store, on the connections a node's pipelines hold and on those of redis-py's pool
(docs/store-hygiene.md, "A restarted Redis and connections it closed"; decision 0081)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from litestar.testing import AsyncTestClient

from kernel.errors import AmbiguousOutcome
from leasehold.local.procs import RedisSentinels, RedisServer
from region_agent.service.app import create_app
from region_agent.store import redis_internals as ri
from region_agent.store.breaker import CLOSED
from region_agent.store.client import make_client, make_sentinel_client, parse_store_url
from region_agent.store.node import RedisNode
from region_agent.store.scripts import Scripts

from .conftest import PEPPER, admit_body, make_settings

pytestmark = pytest.mark.integration

T = "{t:closed}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis").start()
    try:
        yield s
    finally:
        s.stop()


def close_clients(server: RedisServer, how: str) -> None:
    """The server closes every client connection: restarted on the same port (state and script
    cache lost), or ``CLIENT KILL TYPE normal`` — blocking, so the event loop gets no turn here."""
    if how == "restart":
        server.restart()
        return
    with redis.Redis(port=server.port) as admin:
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")


def opened(node: RedisNode) -> list[Any]:
    """The node's open connections: held by its pipelines or idle in the pool."""
    pool = node.client.connection_pool
    held = node._held._idle if node._held is not None else []
    return [c for c in [*held, *pool._available_connections] if c.is_connected]


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "the condition never held"
        await asyncio.sleep(0.005)


def call(key: str) -> list:
    return [("fixed_window", [f"rl:{T}:{key}"], [1_000, 60_000, 1, 0])]


@pytest.fixture(params=["held", "pool"])
async def node(request: pytest.FixtureRequest, server: RedisServer) -> AsyncIterator[RedisNode]:
    """A store node as the agent builds it; ``pool``: its pipelines check a connection out of
    redis-py's pool each (what a client with a streaming credential provider does)."""
    n = RedisNode(make_client(server.url), Scripts(), max_inflight=3)
    if request.param == "pool":
        n._held = None
    n.start()
    await n.load()
    yield n
    await n.close()


async def warm(node: RedisNode) -> int:
    """Several connections open (the agent warms its pool at start), pipelines run; how many."""
    await node.warm(3)
    for _ in range(3):
        replies = await asyncio.gather(*(node.submit(call(f"warm{i}"), wait_s=2.0) for i in range(6)))
        assert all(r[0][0] == 1 for r in replies)
    return len(opened(node))


@pytest.mark.parametrize("how", ["client-kill", "restart"])
async def test_the_pipeline_after_the_server_closed_idle_connections_is_decided_normally(node, server, how):
    """The event loop has read the end of file of every connection the server closed: none of
    them is written on. The pipeline reconnects first, runs its script once and counts nothing
    against the store; so do the script reload after a restart and every pipeline after it."""
    conns = await warm(node)
    assert conns >= 2
    dead = opened(node)
    close_clients(server, how)
    await until(lambda: all(ri.closed_by_server(c) for c in dead))
    for i in range(conns + 1):  # one pipeline per connection the server closed, and one more
        (reply,) = await node.submit(call(f"after{i}"), wait_s=2.0)
        assert not isinstance(reply, BaseException), reply
        assert reply[:2] == [1, 999]  # allowed, and ran once
        assert node.breaker.failures == 0 and node.breaker.state == CLOSED
    with redis.Redis(port=server.port) as admin:
        assert [int(admin.hget(f"rl:{T}:after{i}", "n") or 0) for i in range(conns + 1)] == [1] * (conns + 1)


async def test_a_close_the_event_loop_has_not_read_is_seen_only_after_the_write(node, server):
    """The limit of the check: when the server's close reached this host but the event loop has
    not had a turn to read it, nothing tells the connection is dead without a system call, the
    pipeline is written and its outcome is ambiguous (the engine's rules for that hold: no blind
    resend). That one failure drops every other connection, so the next pipeline is decided."""
    await warm(node)
    scripts, client = node.scripts, node.client
    close_clients(server, "client-kill")  # no await between the close and the write below
    failed = await scripts.run_pipeline(client, call("unseen"), {}, node._held)
    assert isinstance(failed[0], AmbiguousOutcome)
    with redis.Redis(port=server.port) as admin:
        assert admin.hget(f"rl:{T}:unseen", "n") is None  # the server had closed it: the script never ran
    assert opened(node) == []  # the lost connection dropped the held and idle ones with it
    (reply,) = await node.submit(call("next"), wait_s=2.0)
    assert reply[:2] == [1, 999]


async def test_a_sentinel_managed_nodes_connections_closed_by_the_primary_are_reopened(tmp_path: Path):
    """The same for a Sentinel-managed client (its pool reconnects through the sentinels)."""
    sentinels = RedisSentinels(tmp_path / "sentinels", replicas=0, sentinels=1, quorum=1).start()
    n = None
    try:
        n = RedisNode(make_sentinel_client(parse_store_url(sentinels.url)), Scripts(), max_inflight=3)
        assert isinstance(n.client.connection_pool, ri.SentinelConnectionPool)
        n.start()
        await n.load()
        await warm(n)
        dead = opened(n)
        close_clients(sentinels.servers[0], "client-kill")
        await until(lambda: all(ri.closed_by_server(c) for c in dead))
        (reply,) = await n.submit(call("sentinel"), wait_s=2.0)
        assert reply[:2] == [1, 999] and n.breaker.failures == 0
    finally:
        if n is not None:
            await n.close()
        sentinels.stop()


@pytest.fixture
async def agent(server: RedisServer, tmp_path: Path, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    app = create_app(make_settings(server.url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


async def _metric(agent: AsyncTestClient, prefix: str) -> float:
    total = 0.0
    for line in (await agent.get("/metrics")).text.splitlines():
        if line.startswith(prefix):
            total += float(line.split()[-1])
    return total


@pytest.mark.parametrize("how", ["client-kill", "restart"])
async def test_the_decision_after_redis_closed_the_agents_connections_is_not_degraded(agent, server, how):
    """What a caller sees: a restart of Redis (or its closing idle connections) while the agent
    was idle costs the next decisions nothing — no fallback answer (P-READ fails to its local
    bucket), no ambiguous outcome, no breaker count; nor does the store's health check."""
    for i in range(3):
        d = (await agent.post("/v1/admit", json=admit_body(f"before-{how}-{i}", pid=f"U-b{i}"))).json()
        assert d["allowed"] is True and d["fallback"] is False
    close_clients(server, how)
    await asyncio.sleep(0.2)  # the agent is idle: its event loop reads the closes
    health = await agent.get("/v1/health/store")  # a PING on an idle connection of the pool
    assert health.status_code == 200 and health.json()["store"] == "reachable"
    for i in range(4):
        d = (await agent.post("/v1/admit", json=admit_body(f"after-{how}-{i}", pid=f"U-a{i}"))).json()
        assert (d["allowed"], d["fallback"], d["httpStatus"]) == (True, False, 200), d
    assert await _metric(agent, 'leasehold_agent_script_errors_total{error="AmbiguousOutcome"}') == 0
    assert await _metric(agent, "leasehold_agent_degraded_decisions_total{") == 0
    assert await _metric(agent, "leasehold_agent_breaker_opens_total{") == 0
