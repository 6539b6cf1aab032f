"""The committer's grouping (allocator.grouping.form_units): units of at most ``per_unit`` items
within etcd's op and byte limits, at most ``free`` units at once on disjoint pools (none busy),
queue order kept per pool, one epoch per shard and unit, one report per lease and unit, every
item exactly once."""

import random
from types import SimpleNamespace

import pytest

from allocator.grouping import RECORD_BYTES, WINDOW_BYTES, form_units


def _item(pool: str, i: int, *, shard: int = 0, epoch: int = 1, grant: bool = True, window: str = "current",
          lease: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(pool=pool, shard=shard, epoch=epoch, is_grant=grant, window_choice=window if grant else "",
                           lease_id=lease or f"l{i}", n=i)


def _drain(items: list, *, free: int, per_unit: int, max_ops: int = 128, max_bytes: int = 10**9) -> list:
    """Rounds of the committer where every unit finishes before the next round: [[unit, ...], ...]."""
    rounds, ready = [], list(items)
    while ready:
        units, ready = form_units(ready, busy=set(), free=free, per_unit=per_unit, max_ops=max_ops,
                                  max_bytes=max_bytes)
        assert units, "items left but no unit formed with nothing busy"
        rounds.append(units)
    return rounds


def _check_unit(u, max_ops: int, max_bytes: int) -> None:
    shards = {it.shard for it in u.items}
    assert all(len({it.epoch for it in u.items if it.shard == s}) == 1 for s in shards), "two epochs of a shard"
    assert all(it.is_grant == u.is_grant for it in u.items), "grants and reports mixed"
    if u.is_grant:
        windows = {(it.pool, it.window_choice) for it in u.items}
        assert len(shards) + len(windows) + len(u.items) <= max_ops or len(u.items) == 1
        assert len(windows) + len(u.items) <= max_ops or len(u.items) == 1
        assert len(u.items) * RECORD_BYTES + len(windows) * WINDOW_BYTES <= max_bytes or len(u.items) == 1
    else:
        assert len(shards) + 2 * len(u.items) <= max_ops or len(u.items) == 1
        assert len({it.lease_id for it in u.items}) == len(u.items), "two reports of one lease in a unit"


@pytest.mark.parametrize("seed", range(40))
def test_units_cover_every_item_once_with_disjoint_pools_and_order_per_pool(seed):
    rng = random.Random(seed)
    n_pools = rng.choice([1, 2, 5, 50, 1000])
    max_ops = rng.choice([128, 256, 1024])
    max_bytes = rng.choice([10**9, 50_000])
    items = []
    for i in range(rng.randrange(0, 700)):
        pool = f"p{rng.randrange(n_pools)}"
        shard = hash(pool) % 8
        items.append(_item(pool, i, shard=shard, epoch=1 + (i > 400 and shard == 3),  # a re-election of shard 3
                           grant=rng.random() < 0.8, window=rng.choice(["current", "current", "next"]),
                           lease=f"l{rng.randrange(300)}"))
    free, per_unit = rng.choice([1, 2, 4]), rng.choice([1, 3, 64, 600])
    rounds = _drain(items, free=free, per_unit=per_unit, max_ops=max_ops, max_bytes=max_bytes)
    flat = [it for units in rounds for u in units for it in u.items]
    assert sorted(it.n for it in flat) == sorted(it.n for it in items)
    for units in rounds:
        assert 1 <= len(units) <= free
        seen: set[str] = set()
        for u in units:
            assert 1 <= len(u.items) <= per_unit
            _check_unit(u, max_ops, max_bytes)
            pools = {it.pool for it in u.items}
            assert not pools & seen, "two units of one round share a pool"
            seen |= pools
    for p in {it.pool for it in items}:  # queue order per pool survives
        assert [it.n for it in flat if it.pool == p] == [it.n for it in items if it.pool == p]


def test_many_pools_fill_transactions_and_run_side_by_side():
    # etcd's default 128 ops: 63 grants per transaction (1 epoch + 63 windows + 63 grant compares)
    rounds = _drain([_item(f"p{i}", i) for i in range(256)], free=4, per_unit=256, max_ops=128)
    assert [[len(u.items) for u in units] for units in rounds] == [[63, 63, 63, 63], [4]]
    # --max-txn-ops 1024: what is queued spread over the free slots, 64 each
    rounds = _drain([_item(f"p{i}", i) for i in range(256)], free=4, per_unit=64, max_ops=1024)
    assert [[len(u.items) for u in units] for units in rounds] == [[64, 64, 64, 64]]
    # a long queue fills transactions up to etcd's limit: (1024 - 1) // 2 = 511 grants
    rounds = _drain([_item(f"p{i}", i) for i in range(2000)], free=4, per_unit=500, max_ops=1024)
    assert [len(u.items) for u in rounds[0]] == [500, 500, 500, 500]
    rounds = _drain([_item(f"p{i}", i) for i in range(2000)], free=4, per_unit=5000, max_ops=1024)
    assert [len(u.items) for u in rounds[0]] == [511, 511, 511, 467]


def test_one_pool_shares_its_window_compare():
    # 300 grants of one pool and window: 1 epoch + 1 window + 300 grant compares, 301 puts
    (units,) = _drain([_item("hot", i) for i in range(300)], free=4, per_unit=1000, max_ops=1024)
    assert [len(u.items) for u in units] == [300]


def test_busy_pools_wait_and_hold_their_later_items():
    items = [_item("a", 0), _item("b", 1), _item("a", 2), _item("c", 3)]
    units, left = form_units(items, busy={"a"}, free=4, per_unit=64, max_ops=128, max_bytes=10**9)
    assert [it.n for u in units for it in u.items] == [1, 3]
    assert [it.n for it in left] == [0, 2]


def test_a_full_unit_holds_the_rest_of_its_pool():
    items = [_item("a", 0), _item("a", 1), _item("b", 2), _item("a", 3), _item("b", 4)]
    units, left = form_units(items, busy=set(), free=1, per_unit=2, max_ops=128, max_bytes=10**9)
    assert [[it.n for it in u.items] for u in units] == [[0, 1]]
    assert [it.n for it in left] == [2, 3, 4]  # b waits too: the one free slot is taken


def test_one_epoch_per_shard_in_each_unit():
    items = [_item("p0", 0, shard=0, epoch=5), _item("p1", 1, shard=1, epoch=7), _item("p2", 2, shard=0, epoch=9),
             _item("p3", 3, shard=0, epoch=5), _item("p4", 4, shard=1, epoch=7), _item("p5", 5, shard=0, epoch=11)]
    units, left = form_units(items, busy=set(), free=4, per_unit=64, max_ops=128, max_bytes=10**9)
    assert [[it.n for it in u.items] for u in units] == [[0, 1, 3, 4], [2], [5]]
    assert not left


def test_reports_of_one_lease_go_to_separate_units_in_order():
    items = [_item("a", 0, grant=False, lease="x1"), _item("a", 1, grant=False, lease="x2"),
             _item("a", 2, grant=False, lease="x1"), _item("a", 3, grant=False, lease="x3")]
    rounds = _drain(items, free=4, per_unit=64)
    assert [[[it.n for it in u.items] for u in units] for units in rounds] == [[[0, 1]], [[2, 3]]]


def test_grants_and_reports_of_one_pool_alternate_in_queue_order():
    items = [_item("a", 0), _item("a", 1, grant=False), _item("b", 2, grant=False), _item("a", 3)]
    rounds = _drain(items, free=4, per_unit=64)
    assert [[([it.n for it in u.items], u.is_grant) for u in units] for units in rounds] == \
        [[([0], True), ([2], False)], [([1], False)], [([3], True)]]


def test_byte_budget_splits_units():
    units, left = form_units([_item(f"p{i}", i) for i in range(10)], busy=set(), free=4, per_unit=64,
                             max_ops=1024, max_bytes=3 * (RECORD_BYTES + WINDOW_BYTES))
    assert [len(u.items) for u in units] == [3, 3, 3, 1] and not left
