"""The agent's shard routing table (pure): learned from GET /v1/shards and not-leader answers."""

from __future__ import annotations

from kernel.shards import shard_of
from kernel.wire import ReplicaInfo, ShardLeader, ShardMap
from region_agent.leasing.routing import ShardRoutes

PROXIES = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]  # what the agent was configured with
ADVERTISED = {"a1": "http://10.0.0.1:8700", "a2": "http://10.0.0.2:8700"}  # what replicas advertise


def _map(node: str, leaders: dict[int, str], shards: int = 4, revision: int = 10) -> ShardMap:
    return ShardMap(shards=shards, hash="blake2b64-mod", node_id=node, url=ADVERTISED[node], revision=revision,
                    members=[ReplicaInfo(node_id=n, url=u) for n, u in ADVERTISED.items()],
                    leaders=[ShardLeader(shard=s, node_id=leaders.get(s), url=ADVERTISED.get(leaders.get(s, "")),
                                         epoch=revision if s in leaders else None) for s in range(shards)])


def _pool_on(shard: int, shards: int = 4) -> str:
    return next(p for p in (f"pool-{i}" for i in range(1000)) if shard_of(p, shards) == shard)


def test_unsharded_allocators_leave_routing_to_the_preferred_url():
    r = ShardRoutes(list(PROXIES))
    assert r.url_for("atlas-w") is None and not r.sharded
    # a not-leader answer of an unsharded allocator carries no shard: nothing is learned
    r.learn_not_leader({"type": "https://leasehold.dev/problems/not-leader", "leader": ADVERTISED["a1"],
                        "leaderNodeId": "a1", "epoch": 3})
    assert not r.sharded and not r.stale and r.url_for("atlas-w") is None
    r.forget_url(PROXIES[0])
    assert not r.stale


def test_a_map_read_through_a_proxy_ties_nodes_to_configured_urls():
    r = ShardRoutes(list(PROXIES))
    leaders = {0: "a1", 1: "a2", 2: "a1", 3: "a2"}
    r.learn_map(PROXIES[0], _map("a1", leaders))
    # a2's proxy is not known yet (its advertised URL is not configured): the map is stale for it
    assert r.url_for(_pool_on(0)) == PROXIES[0] and r.url_for(_pool_on(1)) is None and r.stale
    r.learn_map(PROXIES[1], _map("a2", leaders))
    assert r.url_for(_pool_on(1)) == PROXIES[1] and not r.stale
    groups = r.split([_pool_on(s) for s in range(4)], fallback="x")
    assert groups == {PROXIES[0]: [0, 2], PROXIES[1]: [1, 3]}


def test_the_newest_map_wins_and_a_not_leader_answer_moves_one_shard():
    r = ShardRoutes(list(ADVERTISED.values()))  # configured with the advertised URLs themselves
    r.learn_map(ADVERTISED["a1"], _map("a1", {0: "a1", 1: "a1", 2: "a1", 3: "a1"}, revision=20))
    r.learn_map(ADVERTISED["a2"], _map("a2", {0: "a2"}, revision=15))  # older: ignored for leaders
    assert r.url_for(_pool_on(0)) == ADVERTISED["a1"]
    r.learn_not_leader({"shard": 0, "shards": 4, "leaderNodeId": "a2", "leader": ADVERTISED["a2"], "epoch": 30})
    assert r.url_for(_pool_on(0)) == ADVERTISED["a2"] and not r.stale
    # an election under way: the shard is unknown and a refresh is due
    r.learn_not_leader({"shard": 1, "shards": 4, "leaderNodeId": None, "leader": None})
    assert r.url_for(_pool_on(1)) is None and r.stale


def test_an_unreachable_replica_forgets_its_shards():
    r = ShardRoutes(list(PROXIES))
    leaders = {0: "a1", 1: "a2", 2: "a1", 3: "a2"}
    r.learn_map(PROXIES[0], _map("a1", leaders))
    r.learn_map(PROXIES[1], _map("a2", leaders))
    r.forget_url(PROXIES[1])
    assert r.url_for(_pool_on(1)) is None and r.url_for(_pool_on(0)) == PROXIES[0] and r.stale


def test_a_change_of_shard_count_resets_the_table():
    r = ShardRoutes(list(PROXIES))
    r.learn_map(PROXIES[0], _map("a1", {s: "a1" for s in range(4)}))
    r.learn_not_leader({"shard": 5, "shards": 8, "leaderNodeId": "a2", "leader": ADVERTISED["a2"]})
    assert r.shards == 8 and r.leader_of == {5: "a2"} and r.stale
