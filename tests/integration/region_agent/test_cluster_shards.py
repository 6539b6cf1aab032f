"""One breaker per Redis Cluster primary, on a real 3-primary cluster (region_agent/store/cluster.py).

* A primary SIGSTOPped during load: the tenants whose slots live on the other primaries see no
  fallback and no 503 from start to end; the stopped primary's tenants get their rules' fail
  modes (P-READ from its local bucket, within that bucket's bound; the closed export rule a 503);
  only that primary's breaker opens, its store health says it is down, and it closes again after
  SIGCONT.
* A replica promoted by a Cluster failover: the dead primary's tenants degrade until the agent's
  slot map names the replica, then the replica answers them from its copy of their buckets.
* A slot migrated while the agent serves it: ``ASK`` during the migration and ``MOVED`` after are
  followed without a fallback, a breaker opening or a lost debit.

Tenants by slot with ``redis-cli --cluster create``'s even split: atlas (slot 4037) on the first
primary, birch (7788) and cedar (8149) on the second, dune (15744) on the third.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis

from leasehold.local.procs import LOOPBACK, RedisCluster
from region_agent.service.app import create_app
from region_agent.store.slots import slot_of
from tests.support.agent import PEPPER, admit_body, agent_process, make_settings
from tests.support.redis_buckets import set_bucket, user_key

ON_FIRST = "atlas"  # the primary these tests stop, kill or migrate
ELSEWHERE = ("birch", "cedar", "dune")
READ_FALLBACK_CAPACITY, READ_FALLBACK_PER_S = 5, 0.25  # P-READ's local bucket (policies/northstar.json)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A private cluster (these tests stop and kill its nodes) whose healthy primaries keep
    serving while one is down (``cluster-require-full-coverage no``)."""
    c = RedisCluster(tmp_path / "cluster", full_coverage=False, node_timeout_ms=1000).start()
    yield c
    c.stop()


def name(node) -> str:  # noqa: ANN001
    return f"{LOOPBACK}:{node.port}"


def metric(text: str, metric_name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    series = f"{metric_name}{{{want}}}" if labels else metric_name
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@dataclass
class Seen:
    tenant: str
    user: str
    route: str
    sent: float
    received: float
    d: dict


async def drive(base: str, seen: list[Seen], stop: asyncio.Event, workers: int = 8) -> None:
    """Bounded load: ``workers`` gateways asking for the four tenants in turn (mostly P-READ for
    four users each, every fifth request an export), until ``stop`` (at most 20,000 requests)."""
    n = itertools.count()

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            i = next(n)
            if i >= 20_000:
                return
            tenant = (ON_FIRST, *ELSEWHERE)[i % 4]
            route = "export" if i % 5 == 4 else "read"
            user = f"U-{i % 16 // 4}"
            body = admit_body(f"cs-{w}-{i:06d}", tenant=tenant, pid=user, route=route)
            sent = time.monotonic()
            r = await client.post(base + "/v1/admit", json=body)
            assert r.status_code == 200, r.text  # every question gets its decision
            seen.append(Seen(tenant, user, route, sent, time.monotonic(), r.json()))
            await asyncio.sleep(0.005)

    async with httpx.AsyncClient(timeout=10) as client:
        await asyncio.gather(*(worker(w, client) for w in range(workers)))


async def test_a_stopped_primary_degrades_only_the_tenants_whose_slots_it_owns(cluster, tmp_path: Path, policy_file):
    first = cluster.owner(slot_of("{t:atlas}"))
    assert first is cluster.nodes[0] and all(cluster.owner(slot_of(f"{{t:{t}}}")) is not first for t in ELSEWHERE)
    url = cluster.url.replace("redis://", "redis+cluster://")
    with agent_process(tmp_path / "agent", url, policy_file, "--breaker-open-ms", "300",
                       "--decision-budget-ms", "250", "--redis-socket-timeout-ms", "400",
                       "--store-health-ms", "200") as (base, _proc):
        seen: list[Seen] = []
        stop = asyncio.Event()
        load = asyncio.create_task(drive(base, seen, stop))
        async with httpx.AsyncClient(timeout=5) as c:
            await asyncio.sleep(1.5)
            assert seen and not load.done()
            stopped_at = time.monotonic()
            first.proc.signal(signal.SIGSTOP)
            try:
                # longer than the cluster's node timeout: the other primaries mark it failed
                down_metrics = ""
                while time.monotonic() - stopped_at < 4.0:
                    await asyncio.sleep(0.5)
                    text = (await c.get(base + "/metrics")).text
                    if metric(text, "leasehold_agent_breaker_state", shard=name(first)) == 2:
                        down_metrics = text
                health = await c.get(base + "/v1/health/store")  # per primary; readiness stays 200
                ready = await c.get(base + "/readyz")
            finally:
                resumed_at = time.monotonic()
                first.proc.signal(signal.SIGCONT)
            # after SIGCONT the first primary's breaker closes again and its tenants are served by it
            deadline = resumed_at + 15
            while True:
                await asyncio.sleep(0.3)
                served = [s for s in seen if s.tenant == ON_FIRST and s.sent > time.monotonic() - 0.5
                          and s.d["source"] == "script"]
                if served:
                    break
                assert time.monotonic() < deadline, "the first primary's tenants were never served by it again"
            stop.set()
            await load
            end = (await c.get(base + "/metrics")).text

    assert down_metrics, "the stopped primary's breaker was never seen open"
    assert ready.status_code == 200
    assert health.status_code == 503 and health.json()["store"] == "degraded", health.text
    assert {sh["shard"]: sh["reachable"] for sh in health.json()["shards"]} == {
        name(n): n is not first for n in cluster.nodes}
    # the tenants of the other primaries: no fallback, no 503, from start to end
    elsewhere = [s for s in seen if s.tenant in ELSEWHERE]
    assert len(elsewhere) > 100
    bad = [(s.tenant, s.route, s.d["reason"], s.d["httpStatus"], s.d["source"]) for s in elsewhere
           if s.d["fallback"] or s.d["httpStatus"] == 503]
    assert not bad, bad[:10]
    during = [s for s in elsewhere if stopped_at < s.sent < resumed_at]
    assert len(during) > 20 and all(s.d["source"] in ("script", "negative_cache") for s in during)
    # the stopped primary's tenant, answered while it was stopped (once the stall was detected): its fail modes
    stalled = [s for s in seen if s.tenant == ON_FIRST and stopped_at + 1.0 < s.sent and s.received < resumed_at]
    reads = [s for s in stalled if s.route == "read"]
    exports = [s for s in stalled if s.route == "export"]
    assert reads and exports
    assert all(s.d["fallback"] for s in reads), [(s.sent - stopped_at, s.received - stopped_at, s.d["source"], s.d["reason"]) for s in reads if not s.d["fallback"]][:5]
    # P-READ's local bucket (local_bounded) admitted some (4 users x 5 tokens, then 0.25 a second each:
    # the load may use them up within the first second of the outage)
    assert any(s.d["allowed"] and s.d["source"] == "local_fallback" for s in seen
               if s.tenant == ON_FIRST and s.route == "read" and stopped_at < s.received < resumed_at)
    assert all(s.d["httpStatus"] == 503 and s.d["reason"] == "LIMITER_UNAVAILABLE" for s in exports), \
        [s.d for s in exports][:3]  # the export rule fails closed
    # the bound: each user's local bucket admitted at most its capacity plus its refill over the outage
    outage = resumed_at - stopped_at + 1.0
    fallback_admits: dict[str, int] = {}
    for s in seen:
        if s.tenant == ON_FIRST and s.route == "read" and s.d["fallback"] and s.d["allowed"]:
            fallback_admits[s.user] = fallback_admits.get(s.user, 0) + 1
    bound = READ_FALLBACK_CAPACITY + READ_FALLBACK_PER_S * outage
    assert fallback_admits and max(fallback_admits.values()) <= bound, (fallback_admits, bound)
    # per-shard metrics: only the first primary's breaker opened; store health said it was down
    assert metric(down_metrics, "leasehold_agent_redis_up", shard=name(first)) == 0
    for node in cluster.nodes[1:]:
        assert metric(down_metrics, "leasehold_agent_breaker_state", shard=name(node)) == 0
        assert metric(down_metrics, "leasehold_agent_redis_up", shard=name(node)) == 1
        assert metric(end, "leasehold_agent_breaker_opens_total", shard=name(node)) == 0
    # opened for the stall; a probe that lands while the cluster still reports the node failed (a
    # loaded machine: the cluster bus catches up after SIGCONT) opens it again, so at least once
    assert metric(end, "leasehold_agent_breaker_opens_total", shard=name(first)) >= 1
    assert metric(end, "leasehold_agent_breaker_state", shard=name(first)) == 0
    assert {metric(end, "leasehold_agent_redis_slots", shard=name(n)) for n in cluster.nodes} == {5461, 5462}


async def _admit(agent: AsyncTestClient, rid: str, **kw) -> dict:
    r = await agent.post("/v1/admit", json=admit_body(rid, **kw))
    assert r.status_code == 200, r.text
    return r.json()


async def _metrics(agent: AsyncTestClient) -> str:
    return (await agent.get("/metrics")).text


async def test_a_replica_promoted_by_failover_serves_its_primarys_tenants(tmp_path: Path, policy_file):
    cluster = RedisCluster(tmp_path / "cluster", full_coverage=False, node_timeout_ms=1000, replicas_of=(0,)).start()
    try:
        first, replica = cluster.nodes[0], cluster.replicas[0]
        assert cluster.owner(slot_of("{t:atlas}")) is first
        url = cluster.url.replace("redis://", "redis+cluster://")
        settings = make_settings(url, policy_file, breaker_open_ms=200, decision_budget_ms=250,
                                 redis_socket_timeout_ms=300, store_health_ms=0)
        app = create_app(settings, pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            assert (await _admit(agent, "failover-0000"))["source"] == "script"
            # U-17's bucket on the first primary: 3 tokens left, frozen (no refill); replicated before the kill
            r = Redis(host=LOOPBACK, port=first.port)
            await set_bucket(r, user_key("atlas", "U-17", "read"), 3_000)
            assert await r.execute_command("WAIT", 1, 2_000) == 1
            await r.aclose()
            first.proc.kill()
            # until the replica is promoted and found: P-READ from its local bucket; birch unaffected
            degraded = promoted = None
            deadline = time.monotonic() + 30
            i = 0
            while promoted is None:
                i += 1
                d = await _admit(agent, f"failover-a-{i:04d}", pid="U-5")
                b = await _admit(agent, f"failover-b-{i:04d}", tenant="birch", pid="U-5")
                assert not b["fallback"] and b["httpStatus"] != 503, b
                if d["fallback"]:
                    degraded = d
                elif degraded is not None and d["source"] == "script":
                    promoted = d
                assert time.monotonic() < deadline, "the promoted replica never served atlas"
                await asyncio.sleep(0.05)
            assert "role:master" in replica.cli("info", "replication")
            # the replica's copy of U-17's bucket: 3 tokens, then the denial (nothing was lost here:
            # WAIT confirmed the copy; an unreplicated tail would come back as a fuller bucket)
            got = [(await _admit(agent, f"failover-u17-{k}"))["allowed"] for k in range(4)]
            assert got == [True, True, True, False]
            text = await _metrics(agent)
            assert metric(text, "leasehold_agent_redis_slots", shard=name(replica)) == 5461
            assert metric(text, "leasehold_agent_breaker_state", shard=name(replica)) == 0
            assert metric(text, "leasehold_agent_breaker_state", shard=name(first)) is None  # retired
            assert (metric(text, "leasehold_agent_redis_topology_changes_total") or 0) >= 1
    finally:
        cluster.stop()


async def test_a_migrating_and_then_migrated_slot_is_followed(cluster, policy_file):
    """While the slot migrates, a one-key call (a concurrency release) whose key is already on the
    target is answered ``ASK`` and sent there after ``ASKING``; a multi-key decision whose keys are
    split between the nodes is answered ``TRYAGAIN`` and degrades per its fail mode, without
    counting against either node. Once every node names the new owner, ``MOVED`` is followed
    and the bucket continues where the old owner left it."""
    first, second = cluster.nodes[0], cluster.nodes[1]
    slot = slot_of("{t:atlas}")
    url = cluster.url.replace("redis://", "redis+cluster://")
    app = create_app(make_settings(url, policy_file, store_health_ms=0), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        r1 = Redis(host=LOOPBACK, port=first.port)
        r2 = Redis(host=LOOPBACK, port=second.port)
        try:
            await set_bucket(r1, user_key("atlas", "U-17", "read"), 10_000)
            assert (await _admit(agent, "mig-0000"))["remaining"] == 9
            export = admit_body("mig-export", route="export")
            assert (await _admit(agent, "mig-export", route="export"))["allowed"]
            id1, id2 = first.cli("cluster", "myid"), second.cli("cluster", "myid")
            # migrating: every key of the slot moved to the second primary, the slot still the first's
            await r2.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", id1)
            await r1.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", id2)
            keys = await r1.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            assert keys
            await r1.execute_command("MIGRATE", LOOPBACK, second.port, "", 0, 5000, "KEYS", *keys)
            release = {k: export[k] for k in ("requestId", "principal", "routeGroup", "tenantId")}
            got = await agent.post("/v1/release", json=release)  # ASK: released on the second primary
            assert got.status_code == 200 and got.json()["released"] == 1, got.text
            d = await _admit(agent, "mig-0001")  # TRYAGAIN (its decision key exists on neither side)
            assert d["fallback"] and d["source"] == "local_fallback", d
            # migrated: every node says the slot is the second primary's; the first answers MOVED
            for node in cluster.nodes:
                node.cli("cluster", "setslot", str(slot), "node", id2)
            d = await _admit(agent, "mig-0002")
            assert (d["allowed"], d["remaining"], d["fallback"], d["source"]) == (True, 8, False, "script"), d
            assert await r2.hget(user_key("atlas", "U-17", "read"), "tokens") == b"8000"
            text = await _metrics(agent)
            for node in cluster.nodes:
                assert metric(text, "leasehold_agent_breaker_opens_total", shard=name(node)) == 0
            deadline = time.monotonic() + 10  # the MOVED made the agent re-read the whole slot map
            while (metric(text, "leasehold_agent_redis_slots", shard=name(first)),
                   metric(text, "leasehold_agent_redis_slots", shard=name(second))) != (5460, 5463):
                assert time.monotonic() < deadline, "the slot map was not re-read after MOVED"
                await asyncio.sleep(0.1)
                text = await _metrics(agent)
            assert metric(text, "leasehold_agent_redis_topology_changes_total") >= 1
        finally:
            await r1.aclose()
            await r2.aclose()
