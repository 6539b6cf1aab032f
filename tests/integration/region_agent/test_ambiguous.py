"""Ambiguous outcomes on a real connection: a fault proxy process between the agent process and
Redis holds the replies (docs/invariants.md I6)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from chaos.proxy import ProxyControl
from leasehold.local.procs import Proc, RedisServer, free_port, wait_port
from tests.support.agent import admit_body, agent_process
from tests.support.policies import ROOT
from tests.support.redis_buckets import bucket_tokens, set_bucket, tenant_key, user_key


async def ambiguous_count(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith('leasehold_agent_script_errors_total{error="AmbiguousOutcome"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
async def proxied(tmp_path: Path, redis_server: RedisServer, redis_url: str, policy_file):
    port, control = free_port(), free_port()
    proxy = Proc("proxy", [sys.executable, "-m", "chaos.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                           f"127.0.0.1:{redis_server.port}", "--control", f"127.0.0.1:{control}"],
                 tmp_path / "proxy", env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).start()
    direct = Redis.from_url(redis_url)
    try:
        wait_port(port, proc=proxy.popen)
        wait_port(control, proc=proxy.popen)
        with agent_process(tmp_path / "agent", f"redis://127.0.0.1:{port}/0", policy_file,
                           # a held reply is ambiguous after 1.5 s: the test heals the link within that of
                           # the retry's send even on a loaded machine (at 300 ms a slow heal left the retry
                           # ambiguous too, and the export degraded); both attempts fit the budget
                           "--decision-budget-ms", "5000", "--redis-socket-timeout-ms", "1500") as (base, _):
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                warm = (await client.post("/v1/admit", json=admit_body("warm-up-0001", pid="U-warm"))).json()
                assert warm["allowed"] is True and warm["fallback"] is False
                yield client, ProxyControl(f"127.0.0.1:{control}"), direct
    finally:
        proxy.stop()
        await direct.aclose()


async def test_idempotent_export_retried_after_a_lost_reply_is_debited_once(proxied):
    agent, proxy, r = proxied
    export = tenant_key("atlas", "export")
    await set_bucket(r, export, 1_000_000)
    await proxy.blackhole("down")  # the script runs, its reply never arrives
    task = asyncio.create_task(agent.post("/v1/admit", json=admit_body("r-e41-lost", route="export")))
    for _ in range(600):  # bounded wait until the first attempt timed out and the retry was decided
        if await ambiguous_count(agent) >= 1:
            break
        await asyncio.sleep(0.01)
    await proxy.heal()
    d = (await task).json()
    # at least the lost reply; on a loaded machine the retry may already be in the blackhole before
    # the heal lands and be ambiguous too - the same decision id replays, so it still debits once
    assert await ambiguous_count(agent) >= 1
    assert d["allowed"] is True and d["fallback"] is False and d["decisionId"] == "r-e41-lost"
    assert await bucket_tokens(r, export) == 990_000  # the replay did not debit again
    assert await r.zcard(export + ":cc") == 1


async def test_cheap_read_with_a_lost_reply_degrades_without_a_blind_retry(proxied):
    agent, proxy, r = proxied
    u = user_key("atlas", "U-amb", "read")
    await set_bucket(r, u, 20_000)  # refill frozen: the follow-up sees exactly what the lost call left
    await proxy.blackhole("down")
    d = (await agent.post("/v1/admit", json=admit_body("read-lost-0001", pid="U-amb"))).json()
    await proxy.heal()
    assert d["allowed"] is True and d["fallback"] is True  # P-READ: local bounded fallback
    assert await ambiguous_count(agent) == 1
    # the script ran exactly once: one unit spent, never refunded, never re-sent
    assert await bucket_tokens(r, u) == 19_000
    follow = (await agent.post("/v1/admit", json=admit_body("read-next-0001", pid="U-amb"))).json()
    assert follow["fallback"] is False and follow["remaining"] == 18
