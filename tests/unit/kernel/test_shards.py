"""kernel.shards: a pool's shard is the same in every process (BLAKE2b, never Python's hash)."""

from __future__ import annotations

import pytest

from kernel.shards import MAX_SHARDS, shard_of, stable_hash64


def test_the_hash_is_stable_across_processes():
    # fixed values: a change here would move pools between shard leaders in a rolling upgrade
    assert stable_hash64("global-read") == 3130721626767722558
    assert (shard_of("global-read", 7), shard_of("atlas-minute", 4)) == (4, 3)


def test_one_shard_maps_everything_to_zero_and_shards_spread():
    assert {shard_of(f"pool-{i}", 1) for i in range(50)} == {0}
    spread = {shard_of(f"pool-{i}", 4) for i in range(200)}
    assert spread == {0, 1, 2, 3}
    assert all(0 <= shard_of(f"p{i}", 16) < 16 for i in range(100))


@pytest.mark.parametrize("shards", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_refused(shards):
    with pytest.raises(ValueError):
        shard_of("p", shards)
