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
from redis.asyncio import Redis as AsyncRedis

from kernel.errors import AmbiguousOutcome, NothingRan
from leasehold.local.procs import RedisSentinels, RedisServer
from region_agent.service.app import create_app
from region_agent.store import redis_internals as ri
from region_agent.store.breaker import CLOSED
from region_agent.store.client import make_client, make_sentinel_client, parse_store_url
from region_agent.store.node import RedisNode
from region_agent.store.scripts import Scripts
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.command_cut import CommandCut, resp_command
from tests.support.redis_buckets import bucket_tokens, set_bucket, tenant_key, user_key
from tests.support.waiting import await_until

pytestmark = pytest.mark.integration

T = "{t:closed}"
#: How long a submit may wait (``wait_s``): what these tests check is the reply, the count in the
#: store and the breaker, never how fast a reply came; long enough that a stalled test process
#: does not turn a right reply into a timed-out one (a wrong one fails at once either way).
WAIT_S = 30.0


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
        replies = await asyncio.gather(*(node.submit(call(f"warm{i}"), wait_s=WAIT_S) for i in range(6)))
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
    assert await await_until(lambda: all(ri.closed_by_server(c) for c in dead)), "the closes were never read"
    for i in range(conns + 1):  # one pipeline per connection the server closed, and one more
        (reply,) = await node.submit(call(f"after{i}"), wait_s=WAIT_S)
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
    (reply,) = await node.submit(call("next"), wait_s=WAIT_S)
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
        assert await await_until(lambda: all(ri.closed_by_server(c) for c in dead)), "the closes were never read"
        (reply,) = await n.submit(call("sentinel"), wait_s=WAIT_S)
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


# --- a call that did not run: NOSCRIPT, then its reload's connection lost -------------------------
# (docs/store-hygiene.md, "A restarted Redis and connections it closed"; decision 0084)
SCRIPT_LOAD = resp_command("SCRIPT", "LOAD")


@pytest.fixture
def cut(server: RedisServer) -> Iterator[CommandCut]:
    """A proxy before the server that cuts the connection a command it is armed with arrives on."""
    with CommandCut(server.port) as proxy:
        yield proxy


def flush_scripts(server: RedisServer) -> None:
    """The server forgets every script (what a restart without persistence does to the cache)."""
    with redis.Redis(port=server.port) as admin:
        admin.script_flush()


@pytest.mark.parametrize("held", [True, False], ids=["held", "pool"])
async def test_a_call_whose_reload_lost_its_connection_did_not_run(server, cut, held):
    """EVALSHA answered NOSCRIPT (it did not run); the SCRIPT LOAD that follows is cut before the
    server reads it, so the call is not sent again: it is ``NothingRan``, never ambiguous. The
    next pipeline reloads the script and runs it once."""
    node = RedisNode(make_client(cut.url), Scripts(), max_inflight=3)
    if not held:
        node._held = None
    node.start()
    try:
        await node.load()
        await warm(node)
        flush_scripts(server)
        cut.arm(SCRIPT_LOAD)
        (failed,) = await node.scripts.run_pipeline(node.client, call("noscript"), {}, node._held)
        assert cut.cuts == 1
        assert type(failed) is NothingRan, failed
        with redis.Redis(port=server.port) as admin:
            assert admin.hget(f"rl:{T}:noscript", "n") is None  # it did not run
        (reply,) = await node.submit(call("noscript"), wait_s=WAIT_S)
        assert reply[:2] == [1, 999]  # ran once, now
    finally:
        await node.close()


async def test_a_pipeline_whose_new_connection_failed_its_handshake_did_not_run(server, cut):
    """A connection lost while the pool's new connection says its handshake (CLIENT SETINFO),
    before any byte of the pipeline is written: nothing ran, not ambiguous."""
    node = RedisNode(make_client(cut.url), Scripts(), max_inflight=3)
    node._held = None
    node.start()
    try:
        await node.load()
        await node.client.connection_pool.disconnect()  # the next pipeline connects anew
        cut.arm(resp_command("CLIENT", "SETINFO"))
        (failed,) = await node.scripts.run_pipeline(node.client, call("handshake"), {}, node._held)
        assert cut.cuts == 1
        assert type(failed) is NothingRan, failed
        with redis.Redis(port=server.port) as admin:
            assert admin.hget(f"rl:{T}:handshake", "n") is None
        (reply,) = await node.submit(call("handshake"), wait_s=WAIT_S)
        assert reply[:2] == [1, 999]
    finally:
        await node.close()


@pytest.fixture
async def cut_agent(cut: CommandCut, policy_file: Path) -> AsyncIterator[AsyncTestClient]:
    app = create_app(make_settings(cut.url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as client:
        yield client


@pytest.mark.parametrize(("route", "record"), [("read", False), ("export", True)])
async def test_a_decision_whose_call_did_not_run_is_sent_again_and_answered_by_the_store(
        cut_agent, cut, server, route, record):
    """P-READ (no decision record) and P-EXPORT (one): the call answered NOSCRIPT and the reload
    lost its connection, so nothing ran; the engine sends the call once more within its budget,
    with or without a record, and the store answers it — no fallback, no 503, nothing counted
    ambiguous or degraded, the bucket debited once."""
    agent = cut_agent
    warm = (await agent.post("/v1/admit", json=admit_body(f"warm-{route}-0001", pid="U-warm"))).json()
    assert warm["allowed"] is True and warm["fallback"] is False
    # P-EXPORT: cost 10 from the tenant's export bucket; P-READ: 1 from the user's (both frozen: no refill)
    key, full, cost = ((tenant_key("atlas", "export"), 1_000_000, 10_000) if record
                       else (user_key("atlas", "U-ns", "read"), 20_000, 1_000))
    direct = AsyncRedis(port=server.port)
    try:
        await set_bucket(direct, key, full)
        flush_scripts(server)
        cut.arm(SCRIPT_LOAD)
        d = (await agent.post("/v1/admit", json=admit_body(f"noscript-{route}-0001", pid="U-ns", route=route))).json()
        assert cut.cuts == 1  # the reload was cut: the first send did not run
        assert (d["allowed"], d["fallback"], d["httpStatus"]) == (True, False, 200), d
        assert await bucket_tokens(direct, key) == full - cost  # debited once, by the second send
        if record:
            assert await direct.zcard(key + ":cc") == 1
    finally:
        await direct.aclose()
    assert await _metric(agent, 'leasehold_agent_script_errors_total{error="NothingRan"}') == 1
    assert await _metric(agent, 'leasehold_agent_script_errors_total{error="AmbiguousOutcome"}') == 0
    assert await _metric(agent, "leasehold_agent_degraded_decisions_total{") == 0
    assert await _metric(agent, "leasehold_agent_breaker_opens_total{") == 0
