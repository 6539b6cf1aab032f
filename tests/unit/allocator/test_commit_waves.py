"""The committer's grouping: transactions of at most max_group grants, waves of concurrent
transactions on disjoint pools, queue order kept per pool, every job exactly once."""

import random
from types import SimpleNamespace

import pytest

from allocator.engine import pool_disjoint_groups


def _jobs(pools: list[str]) -> list:
    return [SimpleNamespace(req=SimpleNamespace(pool=p, lease_id=f"l{i}")) for i, p in enumerate(pools)]


@pytest.mark.parametrize("seed", range(40))
def test_groups_cover_every_job_once_with_disjoint_pools_per_wave(seed):
    rng = random.Random(seed)
    n_pools = rng.choice([1, 2, 5, 50, 1000])
    jobs = _jobs([f"p{rng.randrange(n_pools)}" for _ in range(rng.randrange(0, 600))])
    max_group, per_wave = rng.choice([1, 3, 63]), rng.choice([1, 2, 4])
    waves = pool_disjoint_groups(jobs, max_group, per_wave)
    flat = [j for wave in waves for g in wave for j in g]
    assert sorted(j.req.lease_id for j in flat) == sorted(j.req.lease_id for j in jobs)
    for wave in waves:
        assert 1 <= len(wave) <= per_wave
        seen: set[str] = set()
        for g in wave:
            assert 1 <= len(g) <= max_group
            pools = {j.req.pool for j in g}
            assert not pools & seen, "two transactions of one wave share a pool"
            seen |= pools
    for p in {j.req.pool for j in jobs}:  # queue order per pool survives
        assert [j.req.lease_id for j in flat if j.req.pool == p] == [j.req.lease_id for j in jobs if j.req.pool == p]


def test_many_pools_fill_transactions_and_run_side_by_side():
    waves = pool_disjoint_groups(_jobs([f"p{i}" for i in range(256)]), 63, 4)
    assert [[len(g) for g in w] for w in waves] == [[63, 63, 63, 63], [4]]


@pytest.mark.parametrize("seed", range(20))
def test_with_shards_each_transaction_stays_within_the_compare_budget(seed):
    from allocator.engine import MAX_TXN_OPS

    rng = random.Random(seed)
    jobs = [SimpleNamespace(req=SimpleNamespace(pool=f"p{rng.randrange(300)}", lease_id=f"l{i}"),
                            shard=rng.randrange(64)) for i in range(rng.randrange(1, 600))]
    for j in jobs:  # a pool belongs to one shard
        j.shard = hash(j.req.pool) % 64
    waves = pool_disjoint_groups(jobs, 63, 4, shard_of=lambda j: j.shard)
    flat = [j for wave in waves for g in wave for j in g]
    assert sorted(j.req.lease_id for j in flat) == sorted(j.req.lease_id for j in jobs)
    for wave in waves:
        for g in wave:
            assert len({j.shard for j in g}) + 2 * len(g) <= MAX_TXN_OPS
    for p in {j.req.pool for j in jobs}:  # queue order per pool survives the grouping by shard
        assert [j.req.lease_id for j in flat if j.req.pool == p] == [j.req.lease_id for j in jobs if j.req.pool == p]


def test_one_epoch_per_shard_in_each_generation():
    from allocator.engine import epoch_generations

    def job(shard, epoch, i):
        return SimpleNamespace(shard=shard, epoch=epoch, req=SimpleNamespace(pool=f"p{shard}", lease_id=f"l{i}"))

    jobs = [job(0, 5, 0), job(1, 7, 1), job(0, 9, 2), job(0, 5, 3), job(1, 7, 4), job(0, 11, 5)]
    parts = epoch_generations(jobs)
    assert [[j.req.lease_id for j in p] for p in parts] == [["l0", "l1", "l3", "l4"], ["l2"], ["l5"]]
    for p in parts:
        assert all(len({j.epoch for j in p if j.shard == s}) == 1 for s in {j.shard for j in p})
    single = [job(0, e, i) for i, e in enumerate([3, 3, 4, 3])]  # unsharded: one part per epoch, as before
    assert [[j.epoch for j in p] for p in epoch_generations(single)] == [[3, 3, 3], [4]]
