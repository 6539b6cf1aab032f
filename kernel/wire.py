"""Lease API wire types (allocator <-> region agents). JSON, camelCase, msgspec Structs.

Units: tokens are whole tokens of a pool; times are integer milliseconds. ``*AtMs`` values
are on the allocator leader's wall clock; regions must not compare them with their own
clocks and instead time a lease with ``ttlMs`` from the moment they *sent* the request
(and ``startsInMs`` from the moment they *received* the answer), so delay and skew only
ever shorten a lease.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from .ids import LeaseId, PoolId, RegionName

Tokens = Annotated[int, Meta(ge=0, le=2**40)]
Want = Annotated[int, Meta(ge=1, le=2**40)]

MAX_BATCH = 512


class LeaseRequest(Struct, rename="camel", forbid_unknown_fields=True):
    lease_id: LeaseId  # minted by the region, reused on every retry (idempotency key)
    region: RegionName
    pool: PoolId
    want: Want
    demand: Tokens = 0  # tokens the region spent from this pool over the last few seconds, per second
    window: Literal["current", "next"] = "current"  # "next": prefetch shortly before the boundary


class WindowRef(Struct, rename="camel"):
    index: int  # k = floor(startMs / windowMs)
    start_ms: int
    end_ms: int


class LeaseGrant(Struct, rename="camel"):
    lease_id: str
    pool: str
    region: str
    granted: int  # 0 = the pool has nothing left for this window (a normal denial)
    window: WindowRef
    expires_at_ms: int  # min(issuedAt + leaseTtl, window end), allocator clock
    ttl_ms: int  # expiresAtMs - issuedAtMs: time it from when the request was sent
    starts_in_ms: int  # > 0 only for a prefetched lease: not spendable before this (from receipt)
    epoch: int  # the leader's epoch (its election key's create_revision)
    issued_at_ms: int
    remaining: int  # what the pool had left in this window after this grant
    replayed: bool = False  # True when this answers a retried leaseId from the stored record


class LeaseBatchRequest(Struct, rename="camel", forbid_unknown_fields=True):
    requests: Annotated[list[LeaseRequest], Meta(min_length=1, max_length=MAX_BATCH)]


class LeaseError(Struct, rename="camel"):
    lease_id: str
    status: int
    code: str
    detail: str


class LeaseBatchResponse(Struct, rename="camel"):
    results: list[LeaseGrant | LeaseError]  # in request order


class UsageReport(Struct, rename="camel", forbid_unknown_fields=True, omit_defaults=True):
    """How many tokens of a lease the region spent. Idempotent per leaseId. Sent after the lease
    expired, or — ``closedEarly`` — once the region closed it in its store before expiry (an agent
    shutting down): the region spends none of it any more, so the unspent rest can go back now."""

    lease_id: LeaseId
    region: RegionName
    pool: PoolId
    spent: Tokens
    closed_early: bool = False


class UsageBatchRequest(Struct, rename="camel", forbid_unknown_fields=True):
    reports: Annotated[list[UsageReport], Meta(min_length=1, max_length=MAX_BATCH)]


class UsageReceipt(Struct, rename="camel"):
    lease_id: str
    granted: int
    spent: int
    returned: int  # tokens given back to the pool (0 if the window had closed)
    window_open: bool
    replayed: bool = False


class UsageBatchResponse(Struct, rename="camel"):
    results: list[UsageReceipt | LeaseError]  # in request order


class LeaderInfo(Struct, rename="camel"):
    node_id: str | None
    url: str | None
    epoch: int | None
    is_self: bool = False


class ShardedLeaderInfo(LeaderInfo):
    """``GET /v1/leader`` of a sharded deployment: the leader of shard 0 (``isSelf``: this replica
    leads shard 0 with a fresh lease), how many shards there are and how many this replica leads.
    Which replica leads a pool's shard: ``GET /v1/shards``."""

    shards: int = 1
    leading: int = 0


class RegionShare(Struct, rename="camel"):
    region: str
    granted: int
    leases: int
    returned: int = 0


class PoolWindowView(Struct, rename="camel"):
    pool: str
    limit: int
    window: WindowRef
    remaining: int
    granted: int
    regions: list[RegionShare]
    leases_outstanding: int


class PoolSummary(Struct, rename="camel"):
    id: str
    limit: int
    window_ms: int
    lease_ttl_ms: int
    chunk_min: int
    chunk_max: int
    fallback_per_region: int


class ShardLeader(Struct, rename="camel"):
    """One shard of allocator leadership (``GET /v1/shards``)."""

    shard: int
    node_id: str | None  # None: no leader right now (an election or a handoff is under way)
    url: str | None
    epoch: int | None  # the leader key's create_revision: every grant of the shard's pools carries it


class ReplicaInfo(Struct, rename="camel"):
    node_id: str
    url: str


class ShardMap(Struct, rename="camel"):
    """``GET /v1/shards``: which replica leads each shard, as the answering replica last read it
    from etcd (at ``revision``; a client asking several replicas keeps the highest). A pool's shard
    is ``kernel.shards.shard_of(pool, shards)`` (``hash`` names that function)."""

    shards: int
    hash: str
    node_id: str  # the replica that answered
    url: str  # its advertised URL
    revision: int  # etcd revision of the snapshot (0 when unknown)
    members: list[ReplicaInfo]  # live replicas (sharded deployments only)
    leaders: list[ShardLeader]  # one per shard, in shard order
