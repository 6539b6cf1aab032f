"""The agent's Redis Cluster slot map (region_agent/store/slots.py): pure."""

from __future__ import annotations

import pytest

from region_agent.store.slots import SLOTS, SlotMap, slot_of

# CLUSTER SLOTS as redis-py returns it without a response callback (bytes, nested lists)
REPLY = [
    [0, 5460, [b"127.0.0.1", 7000, b"id0"], [b"127.0.0.1", 7003, b"id3"]],
    [5461, 10922, [b"127.0.0.1", 7001, b"id1"]],
    [10923, 16383, [b"", 7002, b"id2"]],  # an empty host: the host of the node that answered
]


def test_built_from_cluster_slots():
    m = SlotMap.from_cluster_slots(REPLY, "10.0.0.9:7001")
    assert m.owner(0) == m.owner(5460) == "127.0.0.1:7000"
    assert m.owner(5461) == "127.0.0.1:7001"
    assert m.owner(16383) == "10.0.0.9:7002"
    assert m.primaries() == ["127.0.0.1:7000", "127.0.0.1:7001", "10.0.0.9:7002"]
    assert m.slot_counts() == {"127.0.0.1:7000": 5461, "127.0.0.1:7001": 5462, "10.0.0.9:7002": 5461}
    assert m.replicas == {"127.0.0.1:7000": ("127.0.0.1:7003",), "127.0.0.1:7001": (), "10.0.0.9:7002": ()}
    assert m.nodes() == ["127.0.0.1:7000", "127.0.0.1:7001", "10.0.0.9:7002", "127.0.0.1:7003"]
    assert m.uncovered() == 0


def test_keys_route_by_their_hash_tag():
    m = SlotMap.from_cluster_slots(REPLY, "127.0.0.1:7000")
    assert slot_of("rl:v3:{t:atlas}:u:abc:read") == slot_of("{t:atlas}") == 4037
    assert m.owner_of("rl:v3:{t:atlas}:tenant:atlas:all") == "127.0.0.1:7000"
    assert m.owner_of(b"rl:v3:{t:birch}:x") == "127.0.0.1:7001"


def test_moved_patches_one_slot_and_same_compares_owners():
    a = SlotMap.from_cluster_slots(REPLY, "127.0.0.1:7000")
    b = SlotMap.from_cluster_slots(REPLY, "127.0.0.1:7000")
    assert a.same(b)
    assert a.moved(4037, "127.0.0.1:7001") and not a.moved(4037, "127.0.0.1:7001")
    assert a.owner(4037) == "127.0.0.1:7001" and a.owner(4036) == "127.0.0.1:7000"
    assert not a.same(b)


def test_an_empty_or_partial_map():
    assert SlotMap().uncovered() == SLOTS and SlotMap().primaries() == []
    half = SlotMap([(0, 8191, "a:1")])
    assert half.uncovered() == 8192 and half.owner(8192) is None
    with pytest.raises(ValueError):
        SlotMap([(0, SLOTS, "a:1")])
    with pytest.raises(ValueError):
        SlotMap.from_cluster_slots([[0, 10]], "a:1")
