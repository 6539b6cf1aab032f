"""Shards of allocator leadership: which replica should lead which shard, and what a replica
does about it (pure: no I/O, the clock passed in as ``now`` in seconds).

Pools map to a fixed number of shards (``kernel.shards.shard_of``); each shard has its own
leader key ``<prefix>leader/<shard>`` and epoch (that key's create_revision). The intended
owner of a shard among the live replicas is chosen by rendezvous (highest-random-weight)
hashing::

    owner(s, M) = argmax over m in M of (weight(s, m), m),   weight = stable 64-bit hash of "<s>/<m>"

Invariants (checked after every case by ``tests/unit/allocator/test_shards.py``):

* one owner: every shard has exactly one intended owner, a live replica (none if none lives);
* minimal movement: when a replica joins, only shards that now hash to it move (to it); when one
  leaves, only its shards move;
* spread: each of n replicas owns about 1/n of the shards.

Takeover rules (:func:`plan`), applied by every replica to each snapshot it reads from etcd
(with one shard, the plain deployment: the first replica to campaign leads while it lives — no
intended owner, no handoff, so a replica joining never moves the leadership):

* a replica leads a shard when the shard's leader key is attached to its own etcd lease;
* it campaigns (``version == 0`` compare) for a shard without a leader when it is the shard's
  intended owner, or when the shard has had no leader for ``grace_s`` (any live replica then
  takes over, so every shard has a leader while one replica lives);
* it hands off (stops accepting, lets in-flight transactions finish or fail on the epoch
  compare, deletes the key with a ``create_revision == epoch`` compare) a shard it leads whose
  intended owner is now another live replica, unless it took the shard over less than
  ``hold_s`` ago (a replica that cannot campaign would otherwise make it bounce).

Fencing does not depend on any of this being timely: every leader write compares its shard's
epoch in the same etcd transaction (``allocator.transactions``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kernel.shards import stable_hash64


def weight(shard: int, node: str) -> int:
    return stable_hash64(f"{shard}/{node}")


def owner(shard: int, members: Collection[str]) -> str | None:
    """The intended leader of ``shard`` among ``members`` (None when there is no member)."""
    return max(members, key=lambda m: (weight(shard, m), m), default=None)


def intended_owner(shard: int, shards: int, members: Collection[str]) -> str | None:
    """The replica that should lead ``shard`` (None with one shard: whoever leads it keeps it)."""
    return None if shards == 1 else owner(shard, members)


def assignment(shards: int, members: Collection[str]) -> dict[int, str]:
    """shard -> intended owner, for every shard (empty when there is no member)."""
    if not members:
        return {}
    return {s: o for s in range(shards) if (o := owner(s, members)) is not None}  # (every shard: members is not empty)


def spread(assign: Mapping[int, str]) -> dict[str, int]:
    """Shards per owner."""
    out: dict[str, int] = {}
    for node in assign.values():
        out[node] = out.get(node, 0) + 1
    return out


def check_assignment(shards: int, members: Collection[str], assign: Mapping[int, str]) -> list[str]:
    """Violations of "one owner per shard, a live one" (empty = the invariant holds)."""
    out: list[str] = []
    if not members:
        return [f"{len(assign)} shards assigned with no live replica"] if assign else []
    if sorted(assign) != list(range(shards)):
        out.append(f"shards assigned {sorted(assign)[:5]}... are not exactly 0..{shards - 1}")
    out += [f"shard {s} assigned to {n!r}, not a live replica" for s, n in assign.items() if n not in members]
    return out


def check_movement(before_members: Collection[str], after_members: Collection[str],
                   before: Mapping[int, str], after: Mapping[int, str]) -> list[str]:
    """Violations of minimal movement between two assignments whose memberships differ by
    joins and leaves: a shard may only move to a replica that joined or away from one that left."""
    joined = set(after_members) - set(before_members)
    left = set(before_members) - set(after_members)
    out = []
    for s in set(before) & set(after):
        if before[s] != after[s] and before[s] not in left and after[s] not in joined:
            out.append(f"shard {s} moved {before[s]!r} -> {after[s]!r} (joined {sorted(joined)}, "
                       f"left {sorted(left)})")
    return out


@dataclass(frozen=True)
class View:
    """One consistent etcd snapshot as a replica sees it."""

    members: frozenset[str]  # live replicas eligible to lead (membership keys present)
    leaders: Mapping[int, str]  # shard -> node id in its leader key (absent: no leader)


@dataclass(frozen=True)
class ShardPlan:
    campaign: frozenset[int]  # shards to campaign for now
    takeover: frozenset[int]  # the subset of ``campaign`` whose intended owner is another replica
    resign: frozenset[int]  # shards to hand off (stop accepting, drain, delete the key)


NOTHING = ShardPlan(frozenset(), frozenset(), frozenset())


def orphans(prev: Mapping[int, float], view: View, shards: int, now: float) -> dict[int, float]:
    """Since when each shard without a leader has been seen without one (for the grace rule)."""
    return {s: prev.get(s, now) for s in range(shards) if s not in view.leaders}


def plan(me: str, shards: int, view: View, *, led: Collection[int], orphaned_since: Mapping[int, float],
         held_until: Mapping[int, float], now: float, grace_s: float) -> ShardPlan:
    """What replica ``me`` does about ``view``. ``led``: shards whose leader key is attached to
    this replica's etcd lease. A replica whose own membership is not in the view does nothing
    (it takes part in no assignment until etcd shows it alive)."""
    if me not in view.members:
        return NOTHING
    if shards == 1:
        return NOTHING if 0 in led or 0 in view.leaders else ShardPlan(frozenset({0}), frozenset(), frozenset())
    campaign: set[int] = set()
    takeover: set[int] = set()
    resign: set[int] = set()
    for s in range(shards):
        intended = owner(s, view.members)
        if s in led:
            if intended != me and now >= held_until.get(s, 0.0):
                resign.add(s)
        elif s not in view.leaders:
            if intended == me:
                campaign.add(s)
            elif now - orphaned_since.get(s, now) >= grace_s:
                campaign.add(s)
                takeover.add(s)
    return ShardPlan(frozenset(campaign), frozenset(takeover), frozenset(resign))
