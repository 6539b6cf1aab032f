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
