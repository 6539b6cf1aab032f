"""What the allocator keeps in etcd: the key layout under the prefix and the records' types.

Every key (``allocator/README.md``, "etcd keys"):

* ``pools/<pool>/<k>`` — :class:`allocator.allocation.WindowState` of one pool window;
* ``grants/<region>/<leaseId>`` — :class:`GrantRecord`;
* ``leader`` (one shard) or ``leader/<shard>`` (``--shards N > 1``) — :class:`LeaderRecord`, on the
  leading replica's etcd lease; the key's ``create_revision`` is the shard's **epoch**;
* ``members/<nodeId>`` — :class:`MemberRecord`, on the replica's etcd lease;
* ``shards`` — a sharded deployment's shard count (written once; a one-shard deployment keeps
  none: its leader key ``leader`` says it);
* ``compaction`` — :class:`allocator.compaction.CompactionRecord`;
* ``policy/current`` — the published bundle (``kernel.policy_store``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kernel.wire import LeaseGrant


class GrantRecord(msgspec.Struct, rename="camel"):
    """What ``grants/<region>/<leaseId>`` holds: the grant as answered, the request's content (a
    retry with other content is a 409, docs/invariants.md I17), plus its usage report."""

    grant: LeaseGrant
    demand: int = 0
    want: int = 0  # the request's ``want`` (0: a record written before it was kept; not compared)
    requested_window: Literal["current", "next"] | None = None  # the request's ``window`` (None: as ``want`` 0)
    reported: bool = False
    spent: int = 0
    returned: int = 0
    stranded: int = 0
    window_open: bool = False


class LeaderRecord(msgspec.Struct, rename="camel"):
    """A shard's leader key: who leads it and where it answers."""

    node_id: str
    url: str


class MemberRecord(msgspec.Struct, rename="camel"):
    """A live replica (its membership key) and the shard count it was started with."""

    node_id: str
    url: str
    shards: int


class Keys:
    """The key layout under ``prefix`` of a deployment of ``shards`` shards of leadership."""

    def __init__(self, prefix: str, shards: int = 1):
        self.prefix = prefix
        self.shards = shards
        self.leader = f"{prefix}leader".encode()  # the one shard's leader key (shards == 1)
        self.leaders = f"{prefix}leader/".encode()  # prefix of leader/<shard> (shards > 1)
        self.members = f"{prefix}members/".encode()
        self.shard_count = f"{prefix}shards".encode()
        self.compaction = f"{prefix}compaction".encode()
        self.grants = f"{prefix}grants/".encode()
        self.pools = f"{prefix}pools/".encode()

    def leader_of(self, shard: int) -> bytes:
        """The leader key of ``shard``: ``leader`` with one shard, ``leader/<shard>`` with more."""
        return self.leader if self.shards == 1 else self.leaders + str(shard).encode()

    def shard_of_leader_key(self, key: bytes) -> int | None:
        """The shard whose leader key ``key`` is in this layout; None for a leader key of another
        layout (a replica of another shard count) or out of range."""
        if self.shards == 1:
            return 0 if key == self.leader else None
        tail = key[len(self.leaders):] if key.startswith(self.leaders) else b""
        return int(tail) if tail.isdigit() and int(tail) < self.shards else None

    @property
    def keeps_count(self) -> bool:
        """A sharded deployment stores its shard count (``shards``) and campaigns comparing it."""
        return self.shards > 1

    @property
    def other_layout_leader(self) -> bytes | None:
        """A leader key that only a replica of the other layout writes and that must be absent for
        this one to campaign: the one-shard key ``leader`` for a sharded deployment."""
        return None if self.shards == 1 else self.leader

    def member(self, node_id: str) -> bytes:
        return self.members + node_id.encode()

    def window(self, pool: str, index: int) -> bytes:
        return f"{self.prefix}pools/{pool}/{index}".encode()

    def grant(self, region: str, lease_id: str) -> bytes:
        """A lease id is the idempotency key of the region that minted it: one namespace per
        region, so no region can learn whether another region used an id (or claim it)."""
        return f"{self.prefix}grants/{region}/{lease_id}".encode()
