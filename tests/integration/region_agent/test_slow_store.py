"""A Redis slower than every decision, on a real connection: a fault proxy process between the
agent process and Redis delays every reply by more than the decision budget (50 ms) but far
less than the socket timeout. Each decision then waits its budget and degrades, while its
pipeline's answer comes back later — which used to close the breaker again each time, so it
never opened and every decision paid the full wait. What must hold: the breaker opens (decisions
degrade at once, the scripts stop piling into a slow Redis), the answers stay bounded, and it
closes again once Redis is fast."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from chaos.proxy import ProxyControl
from leasehold.local.procs import Proc, RedisServer, free_port, wait_port
from region_agent.store.breaker import CircuitBreaker
from tests.support.agent import admit_body, agent_process
from tests.support.policies import ROOT

pytestmark = pytest.mark.integration


def breaker_state(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('leasehold_agent_breaker_state{shard="default"}'):
            return float(line.split()[-1])
    return -1.0


def decide(client: httpx.Client, n: int, tag: str) -> list[tuple[float, bool]]:
    """``n`` decisions one after another: (milliseconds, fallback) each."""
    out = []
    for i in range(n):
        t = time.perf_counter()
        resp = client.post("/v1/admit", json=admit_body(f"{tag}-{i:06d}", pid=f"{tag}-{i % 40}"))
        assert resp.status_code == 200, resp.text
        out.append(((time.perf_counter() - t) * 1000, resp.json()["fallback"]))
        time.sleep(0.01)
    return out


def evalsha_calls(server: RedisServer) -> int:
    """Script calls the real redis-server has received (``INFO commandstats``), behind the proxy."""
    with redis.Redis(port=server.port) as r:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def decision_seconds(client: httpx.Client) -> tuple[float, float]:
    """The agent's own decision-time histogram (every shard and outcome): decisions counted, and
    those that took at most :data:`WITHIN_S`."""
    total = within = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("leasehold_agent_decision_seconds_count{"):
            total += float(line.split()[-1])
        elif line.startswith("leasehold_agent_decision_seconds_bucket{") and f'le="{WITHIN_S}"' in line:
            within += float(line.split()[-1])
    return total, within


#: What no degraded decision may take, by the agent's own clock: its budget (50 ms) and the
#: re-check a sent call may wait beyond it (``late_s``, 0.5 s) fit in it; a decision that waited
#: for the slow store's socket timeout (1 s) would not. (A bucket of DECISION_SECONDS_BUCKETS.)
WITHIN_S = 1.0


def test_a_redis_slower_than_every_decision_opens_the_breaker(tmp_path: Path, redis_server: RedisServer,
                                                             redis_url: str, policy_file: Path):
    """What is checked is what the agent did, not how fast this machine ran it: once the breaker
    is open the decisions are not sent (the server's own count of script calls), save its
    half-open probes, at most ``half_open_probes`` per ``open_s`` of the time measured around
    them; and each decision stayed within its bounded wait by the agent's own clock."""
    port, control = free_port(), free_port()
    proxy = Proc("proxy", [sys.executable, "-m", "chaos.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                           f"127.0.0.1:{redis_server.port}", "--control", f"127.0.0.1:{control}"],
                 tmp_path / "proxy", env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).start()
    try:
        wait_port(port, proc=proxy.popen)
        wait_port(control, proc=proxy.popen)
        with agent_process(tmp_path / "agent", f"redis://127.0.0.1:{port}/0", policy_file) as (base, _), \
                httpx.Client(base_url=base, timeout=10) as client:
            assert not any(fb for _, fb in decide(client, 10, "fast"))
            faults = ProxyControl(f"127.0.0.1:{control}")
            asyncio.run(faults.latency(150, direction="down"))  # every reply 150 ms late: > 50 ms budget
            counted, _ = decision_seconds(client)
            slow = decide(client, 20, "slow")
            assert breaker_state(client) == 2.0  # open: LeaseholdBreakerOpen
            sent, started = evalsha_calls(redis_server), time.monotonic()
            slow += decide(client, 20, "open")
            elapsed = time.monotonic() - started
            sent = evalsha_calls(redis_server) - sent
            assert all(fb for _, fb in slow)  # degraded by the rules' fail modes (bounded), never a 500
            assert breaker_state(client) == 2.0
            # at once, not after the budget (it was ~75 ms each): the open breaker sends nothing but
            # its probes, so the scripts stop piling into the slow Redis
            probes = CircuitBreaker.half_open_probes * (int(elapsed / CircuitBreaker.open_s) + 1)
            assert sent <= probes, (sent, probes, elapsed)
            total, within = decision_seconds(client)
            assert total - counted == 40 and within == total, (total - counted, total - within, slow)  # bounded
            asyncio.run(faults.heal())
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (decide(client, 5, "heal")[-1][1] or breaker_state(client) != 0):
                pass
            assert breaker_state(client) == 0.0 and not decide(client, 5, "after")[-1][1]
    finally:
        proxy.stop()
