"""Leased balances across a Redis failover (docs/bound.md), on real redis-server processes: a
replica promoted to primary has every lease entry its old primary wrote, but may lag behind the
debits acknowledged there. Such entries are never spendable on the new primary, and closing one
says it is not current, so the agent reports it fully spent."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from redis.asyncio import Redis

from leasehold.local.procs import RedisServer
from region_agent.decision.call import Call, multi_rule_argv

from .support import ScriptCalls

KEY = "rl:v3:{t:failover}:pool:p"


async def _now(r: Redis) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def _spend(scripts: ScriptCalls, r: Redis, cost: int) -> bool:
    keys, argv = multi_rule_argv("rl:v3:{t:failover}:dec", [Call(KEY, "pool", (cost, 0, 0, 0, 0))], slack_ms=1_000,
                                 decision_ttl_ms=0, member="m")
    return (await scripts.multi_rule(r, keys, argv)).allowed


async def test_promoted_replica_never_spends_or_returns_its_primarys_leases(tmp_path: Path):
    primary = RedisServer(tmp_path / "a").start()
    replica = RedisServer(tmp_path / "b").start()
    scripts = ScriptCalls()
    a, b = Redis.from_url(primary.url), Redis.from_url(replica.url)
    try:
        await b.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        deadline = time.monotonic() + 15
        while (await b.info("replication")).get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica never synced"
            await asyncio.sleep(0.05)
        t = await _now(a)
        dep = await scripts.pool_deposit(a, KEY, "L1", granted=50, valid_from_ms=t - 10, expires_at_ms=t + 60_000,
                                         max_entries=16, slack_ms=1_000)
        assert dep.stored
        assert await _spend(scripts, a, 10)
        assert await a.execute_command("WAIT", 1, 2_000) == 1  # the replica has the lease and the debit
        # ---- failover: the replica becomes the primary (a new incarnation)
        await b.execute_command("REPLICAOF", "NO", "ONE")
        assert (await scripts.pool_balance(b, KEY)).spendable() == 0
        assert not await _spend(scripts, b, 1), "a lease written by the old primary was spent on the promoted replica"
        closed = await scripts.pool_close(b, KEY, "L1")
        assert closed is not None and (closed.granted, closed.spent, closed.current) == (50, 10, False)
        # a lease deposited on the new primary is spendable there, and closes as current
        t = await _now(b)
        assert (await scripts.pool_deposit(b, KEY, "L2", granted=5, valid_from_ms=t - 10, expires_at_ms=t + 60_000,
                                           max_entries=16, slack_ms=1_000)).stored
        assert await _spend(scripts, b, 2)
        closed = await scripts.pool_close(b, KEY, "L2")
        assert closed is not None and (closed.granted, closed.spent, closed.current) == (5, 2, True)
    finally:
        await a.aclose()
        await b.aclose()
        replica.stop()
        primary.stop()
