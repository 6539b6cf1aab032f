"""Routing of the cluster store (region_agent/store/cluster.py) without a network: each primary's
node is the real RedisNode (batcher, breaker) over a scripted pipeline runner, and the
topology reads answer a scripted ``CLUSTER SLOTS``. The real cluster: tests/integration/region_agent/test_cluster_shards.py."""

from __future__ import annotations

import asyncio

import pytest

from kernel.errors import StoreUnavailable
from region_agent.store.breaker import OPEN, CircuitBreaker
from region_agent.store.cluster import ClusterStore
from region_agent.store.node import RedisNode
from region_agent.store.scripts import SlotMoved
from region_agent.store.slots import slot_of

A, B, C = "10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"


def cluster_slots(*owners: str) -> list:
    """CLUSTER SLOTS splitting the slots evenly over ``owners``."""
    n, out = len(owners), []
    for i, o in enumerate(owners):
        host, port = o.rsplit(":", 1)
        out.append([16384 * i // n, 16384 * (i + 1) // n - 1, [host.encode(), int(port), b"id"]])
    return out


class Topology:
    def __init__(self, *owners: str):
        self.reply = cluster_slots(*owners)
        self.dead: set[str] = set()
        self.asked: list[str] = []


class FakeClient:
    """What the cluster store asks of a node's client outside the pipelines: CLUSTER SLOTS."""

    def __init__(self, name: str, topo: Topology):
        self.name, self.topo = name, topo

    async def execute_command(self, *args):
        assert args == ("CLUSTER", "SLOTS")
        self.topo.asked.append(self.name)
        if self.name in self.topo.dead:
            raise ConnectionError("down")
        return self.topo.reply

    async def aclose(self):
        pass


class Runner:
    """Each node's pipelines: ``answer(node, call)`` per call (a reply or an error in its place)."""

    def __init__(self, name: str, answer, sent: dict):
        self.name, self.answer, self.sent = name, answer, sent

    async def run_pipeline(self, client, calls, reading, held=None):
        self.sent.setdefault(self.name, []).append([c[1][0] for c in calls])
        return [self.answer(self.name, c) for c in calls]


def store(topo: Topology, answer=lambda node, call: [1, 0, 0, node], **kw):
    sent: dict[str, list] = {}
    retired: list[str] = []
    tops: list[bool] = []

    def make_node(name, on_reachability):
        return RedisNode(FakeClient(name, topo), Runner(name, answer, sent),
                            breaker=CircuitBreaker(failure_threshold=1, open_s=60.0), shard=name,
                            on_reachability=on_reachability)

    s = ClusterStore([A], make_node, lambda name: FakeClient(name, topo), None,  # type: ignore[arg-type]  # no scripts: the fake nodes answer every call
                     on_retire=retired.append, on_topology=lambda m, changed: tops.append(changed), **kw)
    return s, sent, retired, tops


def key(tenant: str) -> str:
    return f"rl:v3:{{t:{tenant}}}:u:x:read"


def owner_index(tenant: str, n: int = 3) -> int:
    return next(i for i in range(n) if 16384 * i // n <= slot_of(key(tenant)) < 16384 * (i + 1) // n)


TENANTS = {owner_index(t): t for t in ("atlas", "birch", "dune", "cedar", "t3", "t4")}  # one tenant per primary


async def test_a_batch_goes_as_one_pipeline_per_primary_and_comes_back_in_order():
    topo = Topology(A, B, C)
    s, sent, _, _ = store(topo)
    assert await s.refresh()
    tenants = [TENANTS[i % 3] for i in range(9)]
    replies = await s.submit([("multi_rule", [key(t)], []) for t in tenants], wait_s=1.0)
    assert [r[3] for r in replies] == [(A, B, C)[owner_index(t)] for t in tenants]
    assert sorted(sent) == [A, B, C] and all(len(p) == 1 and len(p[0]) == 3 for p in sent.values())
    assert s.shard_of(key(TENANTS[1])) == B
    await s.close()


async def test_an_open_breaker_fails_only_its_primarys_calls():
    topo = Topology(A, B, C)
    s, sent, _, _ = store(topo, answer=lambda node, call: StoreUnavailable("down") if node == B else [1, 0, 0, node])
    s.start()
    assert await s.refresh()
    on_b = ("multi_rule", [key(TENANTS[1])], [])
    (reply,) = await s.submit([on_b], wait_s=1.0)
    assert isinstance(reply, StoreUnavailable) and s.nodes[B].breaker.state == OPEN
    with pytest.raises(StoreUnavailable):  # open: nothing sent, the gateway's error (as a standalone store's)
        await s.submit([on_b], wait_s=1.0)
    mixed = await s.submit([("multi_rule", [key(TENANTS[0])], []), on_b, ("multi_rule", [key(TENANTS[2])], [])],
                           wait_s=1.0)
    assert mixed[0][3] == A and isinstance(mixed[1], StoreUnavailable) and mixed[2][3] == C
    assert len(sent[B]) == 1  # nothing more was sent to the open primary
    assert s.breakers() == {A: 0, B: OPEN, C: 0}
    await asyncio.sleep(0.2)  # the open breaker asked for a fresh topology: read from a healthy primary first
    assert topo.asked and topo.asked[-1] != B
    await s.close()


async def test_moved_is_followed_once_and_patches_the_map():
    topo = Topology(A, B)
    t = TENANTS[0]
    slot = slot_of(key(t))

    def answer(node, call):
        return SlotMoved(slot, "10.0.0.2", 7000) if node == A else [1, 0, 0, node]

    s, sent, _, tops = store(topo, answer=answer)
    assert await s.refresh()
    assert s.shard_of(key(t)) == A
    (reply,) = await s.submit([("multi_rule", [key(t)], [])], wait_s=1.0)
    assert reply[3] == B and s.shard_of(key(t)) == B and s.changes == 1 and tops[-1] is True
    assert s.nodes[A].breaker.failures == 0  # a MOVED is not a failure of the node that said it
    (again,) = await s.submit([("multi_rule", [key(t)], [])], wait_s=1.0)
    assert again[3] == B and len(sent[A]) == 1
    await s.close()


async def test_a_failover_retires_the_old_primary_and_serves_the_promoted_one():
    topo = Topology(A, B, C)
    s, _, retired, _ = store(topo)
    assert await s.refresh()
    d = "10.0.0.4:7000"
    topo.reply = cluster_slots(d, B, C)
    topo.dead.add(A)
    assert await s.refresh()
    assert s.map.primaries() == [d, B, C] and retired == [A] and A not in s.nodes
    (reply,) = await s.submit([("multi_rule", [key(TENANTS[0])], [])], wait_s=1.0)
    assert reply[3] == d
    topo.dead |= {B, C, d}
    topo.asked.clear()
    assert not await s.refresh()  # nobody answers: the map stays
    assert s.map.primaries() == [d, B, C] and set(topo.asked) == {A, B, C, d}
    await s.close()


async def test_unknown_topology_and_the_lease_managers_calls():
    topo = Topology(A, B)
    topo.dead |= {A, B}
    s, _, _, _ = store(topo)
    with pytest.raises(StoreUnavailable, match="no Redis Cluster primary"):  # no map, and no node answers
        await s.submit([("multi_rule", [key("atlas")], [])], wait_s=0.2)
    topo.dead.clear()
    (reply,) = await s.submit([("multi_rule", [key("atlas")], [])], wait_s=1.0)  # the map is read on demand
    assert reply[3] == s.shard_of(key("atlas")) and s.map.primaries() == [A, B]
    assert await s.ping() is False  # (the fake nodes do not answer PING)

    class Scripts:  # the lease manager's balance calls go through Scripts.call -> call_script
        async def run_pipeline(self, client, calls, reading=None, held=None):
            return [[client.name]]

    for tenant in ("atlas", "birch", "dune"):
        assert await s.call_script(Scripts(), "pool_balance", [key(tenant)], []) == [(A, B)[owner_index(tenant, 2)]]
    await s.close()
