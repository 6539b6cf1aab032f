"""Shards of leadership, pure: rendezvous assignment and the takeover rules.

After every case: one intended owner per shard among the live replicas, and minimal movement
(a join moves shards only to the newcomer, a leave only the leaver's shards). The protocol
rounds are simulated against a model of the leader keys (a dict with etcd's ``version == 0``
create rule and lease expiry) to check that every shard gets exactly one leader and that
ownership converges to the assignment.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.shards import (
    NOTHING,
    View,
    assignment,
    check_assignment,
    check_movement,
    intended_owner,
    orphans,
    owner,
    plan,
    spread,
)
from kernel.shards import shard_of, stable_hash64


def _check(shards: int, members: set[str], prev_members: set[str] | None = None,
           prev: dict[int, str] | None = None) -> dict[int, str]:
    a = assignment(shards, members)
    assert check_assignment(shards, members, a) == []
    if prev is not None and prev_members is not None:
        assert check_movement(prev_members, members, prev, a) == []
    return a


# ------------------------------------------------------------------------------- shard_of
def test_shard_of_is_pinned_across_processes():
    # a change of the hash would silently re-route every pool: pin a few values
    assert stable_hash64("atlas-w") == int.from_bytes(
        __import__("hashlib").blake2b(b"atlas-w", digest_size=8).digest(), "big")
    assert [shard_of(p, 64) for p in ("atlas-w", "birch-w", "p00000", "p00001")] == \
        [stable_hash64(p) % 64 for p in ("atlas-w", "birch-w", "p00000", "p00001")]
    assert {shard_of(f"p{i}", 1) for i in range(100)} == {0}
    with pytest.raises(ValueError):
        shard_of("p", 0)


def test_pools_spread_over_shards():
    counts = [0] * 64
    for i in range(6_400):
        counts[shard_of(f"p{i:05d}", 64)] += 1
    assert min(counts) >= 60 and max(counts) <= 140  # mean 100


# ------------------------------------------------------------------------------- assignment
def test_three_replicas_each_own_about_a_third():
    a = _check(64, {"alloc-1", "alloc-2", "alloc-3"})
    per = spread(a)
    assert sum(per.values()) == 64 and set(per) == {"alloc-1", "alloc-2", "alloc-3"}
    assert all(14 <= n <= 29 for n in per.values()), per  # 64/3 = 21.3


def test_no_member_no_owner():
    assert assignment(8, set()) == {} and owner(3, []) is None
    assert check_assignment(8, set(), {}) == []
    assert check_assignment(8, set(), {0: "x"}) != []


def test_the_checks_catch_what_they_claim():
    assert check_assignment(4, {"a"}, {0: "a", 1: "a", 2: "a"})  # shard 3 has no owner
    assert check_assignment(2, {"a"}, {0: "a", 1: "b"})  # b is not live
    # a shard moving between two replicas that both stayed is not minimal
    assert check_movement({"a", "b"}, {"a", "b", "c"}, {0: "a"}, {0: "b"})


@pytest.mark.parametrize("shards", [1, 2, 7, 64, 256])
def test_join_and_leave_sequences_move_the_minimum(shards):
    rng = random.Random(shards)
    members: set[str] = set()
    prev: dict[int, str] = {}
    for step in range(60):
        before = set(members)
        if members and (rng.random() < 0.4 or len(members) > 6):
            members.discard(rng.choice(sorted(members)))
        else:
            members.add(f"node-{step}")
        after = _check(shards, members, before, prev)
        if before and members:  # what moved went to the newcomer or came from the leaver
            changed = {s for s in after if prev.get(s) != after[s]}
            assert all(after[s] in members - before or prev[s] in before - members for s in changed)
        prev = after


@settings(max_examples=200, deadline=None)
@given(st.sets(st.text("abcdefgh-0123", min_size=1, max_size=8), min_size=1, max_size=8),
       st.text("abcdefgh-0123", min_size=1, max_size=8), st.integers(1, 128))
def test_one_join_or_leave_is_minimal(members, newcomer, shards):
    before = _check(shards, members)
    after_join = _check(shards, members | {newcomer}, members, before)
    assert all(after_join[s] == newcomer for s in before if before[s] != after_join[s])
    if len(members) > 1:
        leaver = sorted(members)[0]
        after_leave = _check(shards, members - {leaver}, members, before)
        assert all(before[s] == leaver for s in before if before[s] != after_leave[s])


def test_large_shard_counts_balance():
    per = spread(_check(1024, {"a1", "b2", "c3", "d4"}))
    assert all(200 <= n <= 320 for n in per.values()), per  # 256 each on average


# ------------------------------------------------------------------------------- takeover rules
class Keys:
    """A model of the leader keys: shard -> (node, lease); created only if absent (version == 0),
    deleted all at once when a lease expires."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[str, int]] = {}

    def create(self, shard: int, node: str, lease: int) -> bool:
        if shard in self.kv:
            return False
        self.kv[shard] = (node, lease)
        return True

    def delete(self, shard: int, lease: int) -> None:
        if self.kv.get(shard, ("", -1))[1] == lease:
            del self.kv[shard]

    def expire(self, lease: int) -> None:
        self.kv = {s: v for s, v in self.kv.items() if v[1] != lease}


class Replica:
    def __init__(self, node: str, lease: int) -> None:
        self.node, self.lease = node, lease
        self.orph: dict[int, float] = {}
        self.held: dict[int, float] = {}
        self.stuck = False  # alive in etcd (keeps its lease) but never campaigns


def _round(keys: Keys, reps: list[Replica], shards: int, now: float, grace: float = 3.0, hold: float = 30.0,
           order: random.Random | None = None) -> None:
    """Every replica reads a snapshot and acts on it (in a random order: campaigns race)."""
    members = frozenset(r.node for r in reps)
    seq = list(reps)
    if order:
        order.shuffle(seq)
    for r in seq:
        view = View(members, {s: n for s, (n, _lease) in keys.kv.items()})
        r.orph = orphans(r.orph, view, shards, now)
        led = {s for s, (_n, lease) in keys.kv.items() if lease == r.lease}
        p = plan(r.node, shards, view, led=led, orphaned_since=r.orph, held_until=r.held, now=now, grace_s=grace)
        assert p.takeover <= p.campaign and not (p.campaign & p.resign) and p.resign <= led
        if r.stuck:
            continue
        for s in p.resign:
            keys.delete(s, r.lease)
        for s in p.campaign:
            if keys.create(s, r.node, r.lease) and s in p.takeover:
                r.held[s] = now + hold


def _leaders(keys: Keys) -> dict[int, str]:
    return {s: n for s, (n, _l) in keys.kv.items()}


@pytest.mark.parametrize("seed", range(10))
def test_rounds_converge_to_the_assignment_through_joins_and_kills(seed):
    rng = random.Random(seed)
    shards = rng.choice([1, 8, 64])
    keys, now = Keys(), 0.0
    reps = [Replica("r0", 0)]
    before: dict[int, str] = {}
    for step in range(1, 12):
        # stable membership: two rounds (resign, then campaign) reach the assignment
        for _ in range(2):
            now += 0.25
            _round(keys, reps, shards, now, order=rng)
        live = {r.node for r in reps}
        if shards > 1:
            assert _leaders(keys) == assignment(shards, live)
        else:  # one shard: a live leader, the same one while it lives (a join never moves it)
            (leader,) = _leaders(keys).values()
            assert leader in live and (before.get(0) not in live or leader == before[0])
        before = _leaders(keys)
        if rng.random() < 0.4 and len(reps) > 1:
            dead = reps.pop(rng.randrange(len(reps)))
            keys.expire(dead.lease)  # SIGKILL: its lease expires, its keys vanish at once
        else:
            reps.append(Replica(f"r{step}", step))


def test_a_stuck_owner_is_taken_over_after_grace_and_not_bounced():
    keys, shards = Keys(), 16
    a, b = Replica("a", 1), Replica("b", 2)
    b.stuck = True  # b keeps its membership alive but never campaigns
    now = 0.0
    _round(keys, [a, b], shards, now)
    mine = {s for s in range(shards) if owner(s, {"a", "b"}) == "a"}
    assert set(keys.kv) == mine  # b's shards wait for their owner ...
    now += 2.9
    _round(keys, [a, b], shards, now)
    assert set(keys.kv) == mine
    now += 0.2  # ... for grace_s, then a takes them over
    _round(keys, [a, b], shards, now)
    assert set(keys.kv) == set(range(shards)) and set(_leaders(keys).values()) == {"a"}
    for _ in range(20):  # held: a does not hand b's shards back to a replica that does not take them
        now += 0.25
        _round(keys, [a, b], shards, now)
        assert set(keys.kv) == set(range(shards))
    now += 30.0  # the hold ends: a hands off, and (b still stuck) takes them back after grace
    _round(keys, [a, b], shards, now)
    assert set(keys.kv) == mine


def test_a_replica_not_yet_visible_does_nothing():
    view = View(frozenset({"a"}), {})
    assert plan("b", 4, view, led=set(), orphaned_since={}, held_until={}, now=0.0, grace_s=3.0).campaign == set()
    p = plan("a", 4, view, led=set(), orphaned_since={}, held_until={}, now=0.0, grace_s=3.0)
    assert p.campaign == {0, 1, 2, 3} and p.takeover == set()


def test_every_shard_led_while_one_replica_lives():
    keys, now = Keys(), 0.0
    reps = [Replica(f"r{i}", i) for i in range(3)]
    for _ in range(2):
        now += 0.25
        _round(keys, reps, 64, now)
    for dead in (reps.pop(0), reps.pop(0)):
        keys.expire(dead.lease)
        now += 0.25
        _round(keys, reps, 64, now)
        assert set(keys.kv) == set(range(64))
    assert set(_leaders(keys).values()) == {"r2"}


def test_one_shard_goes_to_the_first_campaigner_and_stays():
    view = View(frozenset({"a", "b"}), {})
    for me in ("a", "b"):  # both campaign (whoever etcd lets in first leads)
        assert plan(me, 1, view, led=set(), orphaned_since={}, held_until={}, now=0.0, grace_s=3.0).campaign == {0}
    led = View(frozenset({"a", "b", "c"}), {0: "a"})
    for me in ("a", "b", "c"):  # no intended owner: nobody resigns, nobody campaigns
        p = plan(me, 1, led, led={0} if me == "a" else set(), orphaned_since={0: -100.0}, held_until={}, now=0.0,
                 grace_s=3.0)
        assert p == NOTHING
    assert intended_owner(0, 1, {"a", "b"}) is None and intended_owner(0, 4, {"a", "b"}) in {"a", "b"}
