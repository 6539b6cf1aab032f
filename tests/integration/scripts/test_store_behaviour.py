"""The wrapper's store behaviour: NOSCRIPT reload, cross-slot refusal, pipelines, error
translation, decision records, pools, and exact admission under concurrent clients."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import TimeoutError as RedisTimeoutError

from kernel.errors import AmbiguousOutcome, ScriptRejected, StoreUnavailable
from leasehold.local.procs import free_port
from region_agent.decision.call import Call, MultiRuleResult, multi_rule_argv, parse_multi_rule
from region_agent.store.scripts import KeysNotColocated, PoolClosed, Scripts
from tests.support.waiting import await_until
from tests.support.windows import clear_of_window_edges

from .support import now_ms

pytestmark = pytest.mark.integration

T = "{t:store}"
HOUR_MS = 3_600_000
TB = dict(capacity=20_000, refill=2_000, period_ms=1_000, cost=1_000, slack_ms=0)


async def test_noscript_after_flush_is_reloaded_once(aclient, scripts):
    await aclient.script_flush()
    assert (await aclient.script_exists(scripts.sha("token_bucket"))) in ([False], False)
    r = await scripts.token_bucket(aclient, f"rl:{T}:ns", **TB)
    assert r.allowed and r.remaining == 19_000
    assert (await aclient.script_exists(scripts.sha("token_bucket"))) in ([True], True)
    await aclient.script_flush()
    calls = [("token_bucket", [f"rl:{T}:p1"], [20_000, 2_000, 1_000, 1_000, 0]),
             ("fixed_window", [f"rl:{T}:p2"], [5, 60_000, 1, 0]),
             ("token_bucket", [f"rl:{T}:p3"], ["nan", 2_000, 1_000, 1_000, 0])]
    out = await scripts.run_pipeline(aclient, calls)
    assert out[0] == [1, 19_000, 0] and out[1][:2] == [1, 4]
    assert isinstance(out[2], ScriptRejected)
    # the flushed scripts ran exactly once each: one debit, not two
    assert int(await aclient.hget(f"rl:{T}:p1", "tokens")) == 19_000
    assert int(await aclient.hget(f"rl:{T}:p2", "n")) == 1


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
async def test_a_variant_first_named_after_the_start_is_loaded_by_the_noscript_reload(redis_url, redis_cluster_url,
                                                                                      cluster):
    """The agent loads every script and the one-kind variants at start; a variant of several kinds
    is registered the first time a call names it and loaded where it runs by the NOSCRIPT reload
    (one retry), then called by SHA like any script. A name that is not a variant is refused."""
    s = Scripts()
    c = aredis.RedisCluster.from_url(redis_cluster_url) if cluster else aredis.Redis.from_url(redis_url)
    try:
        await s.load_all(c)
        assert "multi_rule[fw,tb]" not in s.scripts
        t = "{t:" + uuid.uuid4().hex[:8] + "}"
        # the fixed window is an hour and both calls fall in one (clear of its edges): the second's
        # remaining is the first's less one, however long the calls take
        await clear_of_window_edges(HOUR_MS, before_ms=10_000)
        keys, argv = multi_rule_argv(f"rl:{t}:d", [Call(f"rl:{t}:u", "tb", (20_000, 1, HOUR_MS, 1_000, 0)),
                                                  Call(f"rl:{t}:w", "fw", (10, HOUR_MS, 1, 0, 0))],
                                     slack_ms=0, decision_ttl_ms=0, member="m")
        for expected_remaining in ([19_000, 9], [18_000, 8]):
            (reply,) = await s.run_pipeline(c, [("multi_rule[fw,tb]", keys, argv)])
            assert parse_multi_rule(reply).remaining == tuple(expected_remaining)  # ran once per call
        assert "multi_rule[fw,tb]" in s.scripts
        (refused,) = await s.run_pipeline(c, [("multi_rule[tb,fw]", keys, argv)])  # kinds not sorted: not a name
        assert isinstance(refused, ScriptRejected)
    finally:
        await c.aclose()


async def test_cross_slot_keys_are_refused_on_the_cluster(redis_cluster_url, scripts):
    c = aredis.RedisCluster.from_url(redis_cluster_url)
    try:
        await scripts.load_all(c)
        keys, argv = multi_rule_argv("rl:{t:a}:d", [Call("rl:{t:a}:u", "tb", (20_000, 2_000, 1_000, 1_000, 0)),
                                                    Call("rl:{t:b}:u", "tb", (20_000, 2_000, 1_000, 1_000, 0))],
                                     slack_ms=0, decision_ttl_ms=0, member="m")
        with pytest.raises(KeysNotColocated):
            await scripts.multi_rule(c, keys, argv)
        out = await scripts.run_pipeline(c, [("multi_rule", keys, argv)])
        assert isinstance(out[0], ScriptRejected)
        assert await c.exists("rl:{t:a}:u") == 0 and await c.exists("rl:{t:b}:u") == 0
    finally:
        await c.aclose()


async def test_server_crossslot_reply_translates(redis_cluster, scripts):
    """Sent straight to one node (no client-side check), the server itself answers CROSSSLOT."""
    node = redis_cluster.nodes[0]
    c = aredis.Redis.from_url(node.url)
    try:
        await c.script_load(scripts.source("multi_rule"))
        keys = ["{a}1", "{b}2"]
        with pytest.raises(ScriptRejected):
            await scripts.call(c, "multi_rule", keys, ["0", "0", "m", "tb", 1, 1, 1, 1, 0, ""])
    finally:
        await c.aclose()


async def test_unreachable_store_is_store_unavailable(scripts):
    c = aredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    try:
        with pytest.raises(StoreUnavailable) as ei:
            await scripts.token_bucket(c, "k", **TB)
        assert not isinstance(ei.value, AmbiguousOutcome) and ei.value.retriable
        out = await scripts.run_pipeline(c, [("token_bucket", ["k"], [1, 1, 1, 1, 0])])
        assert isinstance(out[0], StoreUnavailable)
        with pytest.raises(StoreUnavailable):
            await scripts.load_all(c)
    finally:
        await c.aclose()


async def test_decision_record_replays_the_answer(aclient, scripts):
    user = f"rl:{T}:dr:u"
    rules = [Call(user, "tb", (2_000, 1, 1_000_000, 1_000, 0))]
    keys, argv = multi_rule_argv(f"rl:{T}:dr:D1", rules, slack_ms=0, decision_ttl_ms=60_000, member="D1")
    first = await scripts.multi_rule(aclient, keys, argv)
    again = await scripts.multi_rule(aclient, keys, argv)
    assert first == again == MultiRuleResult(True, 0, 0, (1_000,))
    assert int(await aclient.hget(user, "tokens")) == 1_000  # debited once
    keys0, argv0 = multi_rule_argv(f"rl:{T}:dr:D1", rules, slack_ms=0, decision_ttl_ms=0, member="D1")
    assert (await scripts.multi_rule(aclient, keys0, argv0)).remaining == (0,)  # ttl 0: no record used


async def test_pool_deposit_spend_close(aclient, scripts):
    key = f"rl:{T}:pool"
    t = now_ms()
    dep = dict(valid_from_ms=t - 10, max_entries=2, slack_ms=1_000)
    assert (await scripts.pool_deposit(aclient, key, "A", granted=5, expires_at_ms=t + 20_000, **dep)).status == "stored"
    r = await scripts.pool_deposit(aclient, key, "A", granted=50, expires_at_ms=t + 20_000, **dep)
    assert (r.stored, r.status, r.entries) == (True, "replay", 1)
    assert (await scripts.pool_deposit(aclient, key, "B", granted=5, expires_at_ms=t + 10_000, **dep)).stored
    r = await scripts.pool_deposit(aclient, key, "C", granted=5, expires_at_ms=t + 10_000, **dep)
    assert (r.stored, r.status) == (False, "full")
    r = await scripts.pool_deposit(aclient, f"rl:{T}:pool2", "C", granted=5, expires_at_ms=t - 1, **dep)
    assert (r.stored, r.status) == (False, "expired") and await aclient.exists(f"rl:{T}:pool2") == 0
    keys, argv = multi_rule_argv(f"rl:{T}:pd", [Call(key, "pool", (7, 0, 0, 0, 0))], slack_ms=1_000,
                                 decision_ttl_ms=0, member="D")
    assert await scripts.multi_rule(aclient, keys, argv) == MultiRuleResult(True, 0, 0, (3,))
    bal = await scripts.pool_balance(aclient, key)
    assert bal.entries["B"].spent == 5 and bal.entries["A"].spent == 2 and bal.spendable() == 3
    assert abs(bal.now_ms - now_ms()) < 60_000
    r = await scripts.multi_rule(aclient, keys, argv)
    assert (r.allowed, r.denied_by, r.retry_after_ms, r.remaining) == (False, 1, 0, (3,))
    assert await scripts.pool_close(aclient, key, "A") == PoolClosed(5, 2, True)
    assert await scripts.pool_close(aclient, key, "A") is None
    assert 0 < await aclient.pttl(key)


async def test_pool_take_buys_a_chunk_no_longer_than_its_leases(aclient, scripts):
    """``pool_take.lua`` (in-process chunks, clamped to the window: docs/bound.md): at least min, at most want, earliest-
    expiring leases first, and the chunk's validity ends with the first lease it took from."""
    key = f"rl:{T}:take:pool"
    t = now_ms()
    dep = dict(valid_from_ms=t - 10, max_entries=4, slack_ms=1_000)
    # A's lease lasts 3 s: the takes below must come before it ends, even on a stalled machine
    assert (await scripts.pool_deposit(aclient, key, "A", granted=5, expires_at_ms=t + 3_000, **dep)).stored
    assert (await scripts.pool_deposit(aclient, key, "B", granted=10, expires_at_ms=t + 20_000, **dep)).stored
    got = await scripts.pool_take(aclient, key, min_tokens=1, want=8, slack_ms=0)
    assert (got.taken, got.remaining) == (8, 7) and 0 < got.valid_for_ms <= 3_000
    got = await scripts.pool_take(aclient, key, min_tokens=8, want=20, slack_ms=0)
    assert (got.taken, got.remaining, got.valid_for_ms) == (0, 7, 0)  # fewer than min: nothing written
    got = await scripts.pool_take(aclient, key, min_tokens=2, want=20, slack_ms=0)
    assert (got.taken, got.remaining) == (7, 0) and 3_000 < got.valid_for_ms <= 20_000
    with pytest.raises(ScriptRejected):
        await scripts.pool_take(aclient, key, min_tokens=3, want=2, slack_ms=0)


async def test_pool_take_per_s_caps_a_chunk_to_what_its_lease_can_spend(aclient, scripts):
    """``per_s`` (in-process chunks sized by demand): a chunk taken from a lease that ends sooner than
    the chunk's validity holds no more than per_s tokens per second of what is left of that lease."""
    key = f"rl:{T}:take:per_s"
    t = now_ms()
    dep = dict(valid_from_ms=t - 10, max_entries=4, slack_ms=1_000)
    assert (await scripts.pool_deposit(aclient, key, "A", granted=50, expires_at_ms=t + 20_000, **dep)).stored
    got = await scripts.pool_take(aclient, key, min_tokens=1, want=40, slack_ms=0, per_s=1)
    t1 = now_ms()
    # 1 per second over what is left of A's 20 s (less the time this test took to get there)
    assert -(-(t + 20_000 - t1) // 1000) <= got.taken <= 20
    assert 0 < got.valid_for_ms <= 20_000 and got.remaining == 50 - got.taken >= 30
    got = await scripts.pool_take(aclient, key, min_tokens=25, want=30, slack_ms=0, per_s=1)
    assert got.taken == 25  # the cap (about 20) is below min: never fewer than min
    assert (await scripts.pool_deposit(aclient, key, "B", granted=50, expires_at_ms=t + 20_000, **dep)).stored
    got = await scripts.pool_take(aclient, key, min_tokens=1, want=30, slack_ms=0, per_s=1, waiting=24)
    assert got.taken == 24  # nor fewer than the requests waiting for the chunk (spent at once)
    with pytest.raises(ScriptRejected):
        await scripts.pool_take(aclient, key, min_tokens=1, want=2, slack_ms=0, per_s=-1)


async def test_pool_window_allowance_counts_every_candidate_window(aclient, scripts):
    """The ``pw`` kind (a pool's fallback allowance per allocator window, docs/bound.md): a call
    is charged to every candidate window and denied when any of them is full."""
    key = f"rl:{T}:pw"

    async def call(lo: int, hi: int, cost: int = 1):
        keys, argv = multi_rule_argv(f"rl:{T}:pw:d", [Call(key, "pw", (3, lo, hi, cost, 10_000))],
                                     slack_ms=0, decision_ttl_ms=0, member="m")
        return await scripts.multi_rule(aclient, keys, argv)

    assert [(await call(100, 100)).allowed for _ in range(2)] == [True, True]
    r = await call(100, 101)  # uncertain: charged to windows 100 and 101
    assert r.allowed and r.remaining == (0,)
    assert not (await call(100, 100)).allowed
    assert (await call(101, 101)).remaining == (1,)  # 101 had one charge; after this one, 1 left
    assert not (await call(101, 101, cost=2)).allowed
    assert 0 < await aclient.pttl(key) <= 10_000
    assert (await call(106, 106)).allowed and set(await aclient.hkeys(key)) >= {b"106", b"x"}
    assert b"100" not in set(await aclient.hkeys(key))  # windows long past are dropped


async def test_lua_dir_default_and_include_expansion(scripts):
    s = Scripts()
    src = s.source("multi_rule")
    assert "@include" not in src.replace("-- >>>", "").split("\n", 30)[-1]
    assert src.count("local TB = {}") == 1 and src.count("local function lh_int") == 1
    files = [n for n in s.scripts if "[" not in n]
    assert len(files) == 16 and len({s.sha(n) for n in s.scripts}) == len(s.scripts)  # variants: SHAs of their own


async def _hammer(url: str, cluster: bool, n_clients: int, per_client: int, call) -> int:
    clients = [aredis.RedisCluster.from_url(url) if cluster else aredis.Redis.from_url(url)
               for _ in range(n_clients)]
    for c in clients:
        # redis-py 8.1's async RedisCluster races when many first commands hit an uninitialised
        # client concurrently; the agent initialises (load_all) before serving
        await c.initialize() if cluster else await c.ping()
    try:
        async def one(c, i):
            return await call(c, i)
        results = await asyncio.gather(*(one(c, ci * per_client + j) for ci, c in enumerate(clients)
                                         for j in range(per_client)))
    finally:
        for c in clients:
            await c.aclose()
    return sum(results)


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
async def test_concurrent_clients_admit_exactly_the_limit(request, scripts, topology):
    url = request.getfixturevalue("redis_url" if topology == "standalone" else "redis_cluster_url")
    cluster = topology == "cluster"
    first = aredis.RedisCluster.from_url(url) if cluster else aredis.Redis.from_url(url)
    await scripts.load_all(first)
    await first.aclose()
    limit = 25
    # a token bucket that does not refill within the test (1 millitoken per 10^11 ms)
    tb = dict(capacity=limit * 1_000, refill=1, period_ms=10**11, cost=1_000, slack_ms=0)

    async def bucket(c, i):
        return int((await scripts.token_bucket(c, f"rl:{T}:race:tb", **tb)).allowed)

    assert await _hammer(url, cluster, 6, 30, bucket) == limit

    async def log(c, i):
        return int((await scripts.sliding_log(c, f"rl:{T}:race:sl", limit=limit, window_ms=600_000,
                                              member=f"r{i}")).allowed)

    assert await _hammer(url, cluster, 6, 30, log) == limit

    async def multi(c, i):
        keys, argv = multi_rule_argv(f"rl:{T}:race:d{i}", [
            Call(f"rl:{T}:race:cc", "cc", (limit, 600_000, 0, 0, 0)),
            Call(f"rl:{T}:race:gcra", "gcra", (10**6, 1, 10**6, 1_000, 0))], slack_ms=0,
            decision_ttl_ms=10_000, member=f"lease-{i}")
        return int((await scripts.multi_rule(c, keys, argv)).allowed)

    assert await _hammer(url, cluster, 6, 30, multi) == limit


async def test_timeout_after_send_is_ambiguous(redis_url, scripts):
    """The server is busy (another client's 3 s script), our EVALSHA is sent and times out:
    AmbiguousOutcome. Whether it ran depends on whether the server read it before the client
    dropped the connection: the state is either untouched or debited exactly once. The call is
    sent once the server has stopped answering (the script runs), not after a fixed sleep."""
    blocker = aredis.Redis.from_url(redis_url)
    c = aredis.Redis.from_url(redis_url, socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
    key = f"rl:{T}:ambiguous"

    async def busy() -> bool:
        probe = aredis.Redis.from_url(redis_url, socket_timeout=0.05, retry=Retry(NoBackoff(), 0))
        try:
            await probe.ping()
            return False
        except RedisTimeoutError:
            return True
        finally:
            await probe.aclose()

    try:
        await scripts.load_all(blocker)
        await c.ping()
        busy_script = asyncio.create_task(blocker.eval(
            "local t = redis.call('TIME'); local s = t[1] * 1000000 + t[2]; local n = s "
            "while n - s < 3000000 do t = redis.call('TIME'); n = t[1] * 1000000 + t[2] end return 1", 0))
        assert await await_until(busy, within_s=2.5, interval=0.01), "the server never ran the busy script"
        with pytest.raises(AmbiguousOutcome):
            await scripts.token_bucket(c, key, **TB)
        assert await busy_script == 1
        assert await blocker.hget(key, "tokens") in (None, b"19000")
    finally:
        await c.aclose()
        await blocker.aclose()


async def test_pipeline_answers_each_call_separately(aclient, scripts):
    out = await scripts.run_pipeline(aclient, [
        ("no_such_script", [f"rl:{T}:x"], []),
        ("fixed_window", [f"rl:{T}:pw"], [1, 60_000, 1, 0]),
        ("fixed_window", [f"rl:{T}:pw"], [1, 60_000, 1, 0]),
    ])
    assert isinstance(out[0], ScriptRejected)
    assert out[1][0] == 1 and out[2][:2] == [0, 0]


async def test_buffered_replies_read_from_hiredis_equal_redis_py_reads(aclient, scripts, monkeypatch):
    """read_replies takes the replies buffered behind a pipeline's first one straight from hiredis;
    with that path switched off (redis-py reads every reply) a long pipeline of answers, error
    replies and a NOSCRIPT reload must come back the same."""
    from region_agent.store import redis_internals as ri

    def calls(tag: str) -> list:
        out = []
        for i in range(300):
            if i % 50 == 7:
                out.append(("token_bucket", [f"rl:{T}:{tag}:bad{i}"], ["nan", 2_000, 1_000, 1_000, 0]))
            else:
                out.append(("fixed_window", [f"rl:{T}:{tag}:w{i % 40}"], [3, 60_000, 1, 0]))
        return out

    fast = await scripts.run_pipeline(aclient, calls("fast"))
    monkeypatch.setattr(ri, "FAST_READS", False)
    slow = await scripts.run_pipeline(aclient, calls("slow"))
    norm = [type(r).__name__ if isinstance(r, BaseException) else r[:2] for r in fast]
    assert norm == [type(r).__name__ if isinstance(r, BaseException) else r[:2] for r in slow]
    assert norm.count("ScriptRejected") == 6 and sum(1 for r in norm if r == [0, 0]) > 100
    await aclient.script_flush()
    monkeypatch.undo()
    again = await scripts.run_pipeline(aclient, calls("again"))  # NOSCRIPT on every call: reloaded, run once
    assert [type(r).__name__ if isinstance(r, BaseException) else r[:2] for r in again] == norm


async def test_pipelines_written_straight_to_the_transport_equal_redis_py_sends(aclient, scripts, monkeypatch):
    """write_now hands a standalone pipeline to the connection's transport without redis-py's
    send (a task per send on Python 3.11); with it switched off every pipeline goes through
    send_packed_command: the same answers."""
    from region_agent.store import redis_internals as ri

    def calls(tag: str) -> list:
        return [("fixed_window", [f"rl:{T}:{tag}:w{i % 7}"], [3, 60_000, 1, 0]) for i in range(100)]

    direct = await scripts.run_pipeline(aclient, calls("direct"))
    monkeypatch.setattr(ri, "write_now", lambda conn, payload: False)
    via_redis_py = await scripts.run_pipeline(aclient, calls("redispy"))
    assert [r[:2] for r in direct] == [r[:2] for r in via_redis_py]
    assert sum(1 for r in direct if r[0] == 1) == 21  # 3 per key, 7 keys


async def test_a_direct_write_declines_what_redis_py_must_handle(redis_url, monkeypatch):
    """write_now declines (redis-py sends) on a connection that is not open, that has a health
    check to run, or whose transport still holds unsent bytes (redis-py drains under its timeout)."""
    from region_agent.store import redis_internals as ri

    client = aredis.Redis.from_url(redis_url)
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        assert ri.write_now(conn, b"PING\r\n") is True
        assert await conn.read_response() == b"PONG"
        conn.health_check_interval = 30
        assert ri.write_now(conn, b"PING\r\n") is False
        conn.health_check_interval = 0
        monkeypatch.setattr(conn._writer.transport, "get_write_buffer_size", lambda: 1)
        assert ri.write_now(conn, b"PING\r\n") is False
        monkeypatch.undo()
        await conn.disconnect()
        assert ri.write_now(conn, b"PING\r\n") is False
    finally:
        await pool.release(conn)
        await client.aclose()


async def test_a_held_connection_is_sendable_exactly_when_the_pools_checkout_finds_it_clean(redis_url):
    """sendable() decides whether a connection held since its last pipeline is written on
    without the pool's checkout: true exactly when redis-py's checkout (ensure_connection: connect,
    can_read) would find nothing to deal with, and its release nothing to reconnect — open, nothing
    unread, not closed by the server, not marked to reconnect."""
    from region_agent.store import redis_internals as ri

    client = aredis.Redis.from_url(redis_url)
    killer = aredis.Redis.from_url(redis_url)
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        assert ri.sendable(conn) and not await conn.can_read()
        await conn.send_command("PING")  # a reply nobody read yet
        assert await await_until(lambda: not ri.sendable(conn), interval=0.005), "the reply never arrived"
        assert await conn.can_read()
        assert await conn.read_response() == b"PONG"
        assert ri.sendable(conn) and not await conn.can_read()
        conn.mark_for_reconnect()
        assert not ri.sendable(conn)
        conn.reset_should_reconnect()
        assert ri.sendable(conn)
        await conn.send_command("CLIENT", "ID")
        cid = await conn.read_response()
        assert not ri.closed_by_server(conn)
        await killer.execute_command("CLIENT", "KILL", "ID", cid)  # the server closes it
        assert await await_until(lambda: not ri.sendable(conn), interval=0.005), "the close was never read"
        assert await conn.can_read() and ri.closed_by_server(conn)
        await conn.disconnect()
        assert not ri.sendable(conn)
    finally:
        await pool.release(conn)
        await client.aclose()
        await killer.aclose()


async def test_a_nodes_pipelines_keep_their_connection_instead_of_a_checkout_each(redis_url, scripts, monkeypatch):
    """A store node's pipelines run on connections held between pipelines (no pool checkout or
    release per pipeline); a held connection the server closed goes back through the pool's
    checkout, which reconnects it before the write (the agent's pool, region_agent.store.client),
    and a connection lost mid-pipeline is dropped with every held one: the next pipeline
    connects again."""
    import redis as sync_redis

    from region_agent.store import redis_internals as ri
    from region_agent.store.client import make_client

    client = make_client(redis_url)
    killer = aredis.Redis.from_url(redis_url)
    await scripts.load_all(client)
    held = ri.HeldConnections.of(client, 3)
    assert held is not None
    pool = client.connection_pool
    checkouts = 0
    real_checkout = pool.get_connection

    async def counted():
        nonlocal checkouts
        checkouts += 1
        return await real_checkout()

    monkeypatch.setattr(pool, "get_connection", counted)
    calls = [("fixed_window", [f"rl:{T}:held{i}"], [1_000, 60_000, 1, 0]) for i in range(5)]
    try:
        for _ in range(20):
            out = await scripts.run_pipeline(client, calls, {}, held)
            assert [r[0] for r in out] == [1] * 5
        assert checkouts == 1 and len(held._idle) == 1
        conn = held._idle[0]
        assert conn in pool._in_use_connections  # checked out of the pool while held

        # closed by the server while held: not written on; back to the pool, whose checkout reconnects it
        await killer.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert await await_until(lambda: not ri.sendable(conn), interval=0.005), "the close was never read"
        assert ri.closed_by_server(conn)
        seen = []
        real_release = pool.release

        async def release(c):
            seen.append(c)
            await real_release(c)

        monkeypatch.setattr(pool, "release", release)
        out = await scripts.run_pipeline(client, calls, {}, held)
        assert seen[0] is conn and checkouts == 2  # the pool's checkout judged it, as before holding
        assert [r[0] for r in out] == [1] * 5  # reconnected before the write: answered, not ambiguous
        assert held._idle == [conn] and conn.is_connected and not ri.closed_by_server(conn)

        # closed with no event-loop turn before the write: lost after it was sent, dropped with every held one
        with sync_redis.Redis.from_url(redis_url) as blocking:
            blocking.execute_command("CLIENT", "KILL", "TYPE", "normal")
        failed = await scripts.run_pipeline(client, calls, {}, held)
        assert all(isinstance(r, AmbiguousOutcome) for r in failed)  # the engine's rules for it: no blind resend
        assert held._idle == [] and not conn.is_connected  # dropped, not held

        out = await scripts.run_pipeline(client, calls, {}, held)  # connects again
        assert [r[0] for r in out] == [1] * 5 and checkouts == 3 and len(held._idle) == 1
        assert held._idle[0].is_connected

        await held.drop()  # the store failed over: held connections are closed and given back
        assert held._idle == [] and pool._in_use_connections == set()
    finally:
        await client.aclose()
        await killer.aclose()


async def test_no_connection_is_held_for_a_streaming_credential_provider(redis_url):
    """Its re-authentication runs when a connection is released to the pool: such a pool sees
    every pipeline's checkout and release."""
    from redis.credentials import StreamingCredentialProvider

    from region_agent.store import redis_internals as ri

    class Streaming(StreamingCredentialProvider):
        def get_credentials(self):
            return ("default", "")

        def on_next(self, callback):
            pass

        def on_error(self, callback):
            pass

        def is_streaming(self):
            return True

    plain = aredis.Redis.from_url(redis_url)
    streaming = aredis.Redis.from_url(redis_url, credential_provider=Streaming())
    try:
        assert ri.HeldConnections.of(plain, 3) is not None
        assert ri.HeldConnections.of(streaming, 3) is None
        assert ri.HeldConnections.of(object(), 3) is None
    finally:
        await plain.aclose()
        await streaming.aclose()
