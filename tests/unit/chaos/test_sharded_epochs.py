"""Epoch checks with shards of allocator leadership: epochs are compared within a shard only
(a sharded run says so in its meta record), and a stale commit within a shard is still caught."""

from __future__ import annotations

from chaos import invariants as inv
from chaos.checker import check
from chaos.history import Leader, Meta
from chaos.invariants import GrantSighting
from kernel.shards import shard_of

SHARDS = 8
A = next(f"pool-{i}" for i in range(100) if shard_of(f"pool-{i}", SHARDS) == 1)
B = next(f"pool-{i}" for i in range(100) if shard_of(f"pool-{i}", SHARDS) == 2)


def _shard(pool: str) -> int:
    return shard_of(pool, SHARDS)


def g(lease: str, pool: str, epoch: int, rev: int | None = None, received: int | None = None,
      region: str = "eu") -> GrantSighting:
    return GrantSighting(lease_id=lease, pool=pool, region=region, granted=5, window_index=1, epoch=epoch,
                       commit_revision=rev, received_at_ms=received)


def test_an_older_epoch_of_another_shard_is_not_stale():
    # shard 2 elected epoch 50 at revision 50; shard 1 keeps committing under its epoch 20
    grants = [g("l-b", B, 50, rev=51), g("l-a", A, 20, rev=60)]
    assert inv.no_stale_epoch_commit(grants, [], _shard) == []
    assert inv.no_stale_epoch_commit(grants, []) != []  # one shard (unsharded): it would be stale


def test_a_stale_commit_within_a_shard_is_caught():
    terms = [inv.LeaderTerm(epoch=40, elected_revision=40, shard=_shard(A))]
    grants = [g("l-a", A, 20, rev=45)]
    (v,) = inv.no_stale_epoch_commit(grants, terms, _shard)
    assert (v.lease_id, v.observed, v.bound) == ("l-a", 45, 40)
    # a newer epoch of another shard says nothing about this one
    other = [inv.LeaderTerm(epoch=40, elected_revision=40, shard=_shard(B))]
    assert inv.no_stale_epoch_commit(grants, other, _shard) == []


def test_region_side_epochs_are_per_shard():
    received = [g("l-b", B, 50, received=1_000), g("l-a", A, 20, received=2_000)]
    assert inv.no_stale_epoch_accept(received, _shard) == []
    assert inv.no_stale_epoch_accept(received + [g("l-a2", A, 10, received=3_000)], _shard) != []


def test_the_checker_reads_the_shard_count_from_the_meta_record():
    from chaos.history import EtcdGrant

    recs = [Meta(scenario="s", seed=1, started_at_ms=0, shards=SHARDS),
            Leader(epoch=50, node="n2", observed_at_ms=1, shard=_shard(B)),
            EtcdGrant(lease_id="l-b", pool=B, region="eu", granted=5, window_index=1, epoch=50, mod_revision=51),
            EtcdGrant(lease_id="l-a", pool=A, region="eu", granted=5, window_index=1, epoch=20, mod_revision=60)]
    assert check(recs).verdict("no_stale_epoch_commit").ok
    unsharded = [r for r in recs if not isinstance(r, Meta)]
    assert not check(unsharded).verdict("no_stale_epoch_commit").ok
