"""The models' defensive rules (what the scripts refuse or clamp)."""

import math

import pytest

from kernel.algorithms import fixed_window, gcra, hot_chunk, pool, sliding_counter, sliding_log, token_bucket
from kernel.algorithms.common import InvalidArguments
from kernel.algorithms.fixed_window import FixedWindowState, WindowParams
from kernel.algorithms.gcra import GcraState
from kernel.algorithms.multi_rule import RuleSpec
from kernel.algorithms.multi_rule import decide as multi
from kernel.algorithms.pool import PoolEntry, PoolParams, PoolState
from kernel.algorithms.sliding_counter import SlidingCounterState
from kernel.algorithms.token_bucket import TokenBucketParams, TokenBucketState
from kernel.errors import ScriptRejected

T0 = 1_700_000_000_000
BAD = [math.nan, math.inf, -math.inf, 1.5, -1, 0, 2**40 + 1, True, "7", None]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("field", range(4))
def test_bucket_rejects_bad_numbers(bad, field):
    args = [20_000, 2_000, 1_000, 1_000]
    args[field] = bad
    with pytest.raises(InvalidArguments):
        TokenBucketParams(*args)


def test_rejections_are_script_rejected_and_bounds_inclusive():
    assert issubclass(InvalidArguments, ScriptRejected)
    TokenBucketParams(2**40, 1, 2**12, 1)  # product exactly 2^52 is allowed
    TokenBucketParams(20_000.0, 2_000, 1_000, 1_000)  # an integral float is an integer
    with pytest.raises(InvalidArguments):
        TokenBucketParams(2**40, 1, 2**12 + 1, 1)
    with pytest.raises(InvalidArguments):
        WindowParams(2**30, 2**23)  # limit x window over 2^52
    with pytest.raises(InvalidArguments):
        TokenBucketParams(1_000, 0, 1_000, 1)  # refill 0 is a policy error


def test_cost_over_capacity_never_and_untouched():
    p = TokenBucketParams(1_000, 1_000, 1_000, 2_000)
    d, new = token_bucket.decide(TokenBucketState(1_000, T0), p, T0)
    assert d.as_reply() == [0, 0, -1] and new is None
    d, new = gcra.decide(None, p, T0)
    assert d.as_reply() == [0, 0, -1] and new is None
    for mod in (fixed_window, sliding_counter):
        d, new = mod.decide(None, WindowParams(5, 1_000, 6), T0)
        assert d.as_reply() == [0, 0, -1] and new is None


def test_gcra_unreachable_by_rounding_is_never():
    # cost == capacity but ceil(cost*period/refill) > floor(capacity*period/refill)
    p = TokenBucketParams(10, 3, 1, 10)
    d, _ = gcra.decide(None, p, T0)
    assert d.retry_after_ms == -1


def test_bucket_clock_backwards_no_refill_and_ts_kept():
    p = TokenBucketParams(20_000, 2_000, 1_000, 1_000)
    st = TokenBucketState(5_000, T0 + 3_000)  # stored ts ahead of now
    d, new = token_bucket.decide(st, p, T0)
    assert d.remaining == 4_000 and new == TokenBucketState(4_000, T0 + 3_000)


def test_bucket_forward_jump_clamped_and_lowered_capacity():
    p = TokenBucketParams(20_000, 2_000, 1_000, 1_000)
    d, new = token_bucket.decide(TokenBucketState(0, T0 - 10**12), p, T0)
    assert d.remaining == 19_000 and new.ts == T0
    lowered = TokenBucketParams(5_000, 2_000, 1_000, 1_000)
    d, _ = token_bucket.decide(TokenBucketState(20_000, T0), lowered, T0)
    assert d.remaining == 4_000


def test_bucket_floor_refill_ceil_retry():
    p = TokenBucketParams(3_000, 1_000, 3, 1_000)  # 333.33 millitokens per ms
    d, _ = token_bucket.decide(TokenBucketState(0, T0), p, T0 + 1)
    assert d.as_reply() == [0, 333, 3]  # floor(333.3) refilled; ceil(667*3/1000)=3


def test_gcra_clock_backwards_strict_and_lowered_capacity():
    p = TokenBucketParams(20_000, 2_000, 1_000, 1_000)
    d, new = gcra.decide(GcraState(T0 + 9_000), p, T0)
    assert d.allowed and new.tat == T0 + 9_500
    lowered = TokenBucketParams(2_000, 2_000, 1_000, 1_000)  # B = 1,000 ms
    d, new = gcra.decide(GcraState(T0 + 9_000), lowered, T0)
    assert d.as_reply() == [0, 0, 8_500] and new is None


def test_windows_future_start_is_current_window():
    p = WindowParams(3, 1_000)
    now = T0 + 100
    d, _ = fixed_window.decide(FixedWindowState(T0 + 5_000, 3), p, now)
    assert d.as_reply() == [0, 0, 5_900]
    d, new = sliding_counter.decide(SlidingCounterState(T0 + 5_000, 1, 2), p, now)
    assert not d.allowed and new is None  # prev still weighs fully: 2*1000 + 1000 + 1000 > 3000


def test_sliding_counter_lowered_limit_clamps_counts():
    d, _ = sliding_counter.decide(SlidingCounterState(T0, 10**9, 10**9), WindowParams(10, 1_000), T0)
    assert d.as_reply()[:2] == [0, 0]


def test_pool_spends_earliest_expiring_first_and_splits():
    st = PoolState({
        "a": PoolEntry(5, 0, T0 - 10, T0 + 2_000),
        "b": PoolEntry(5, 1, T0 - 10, T0 + 1_000),
        "c": PoolEntry(50, 0, T0 + 500, T0 + 3_000),  # not valid yet
        "d": PoolEntry(50, 0, T0 - 900, T0),  # expired
    })
    d, new = pool.decide(st, PoolParams(6), T0)
    assert d.as_reply() == [1, 3, 0]
    assert new.entries["b"].spent == 5 and new.entries["a"].spent == 2
    d, none = pool.decide(new, PoolParams(4), T0)
    assert d.as_reply() == [0, 3, 500] and none is None
    d, _ = pool.decide(PoolState({}), PoolParams(1), T0)
    assert d.as_reply() == [0, 0, 0]


def test_pool_deposit_and_close():
    status, st = pool.deposit(None, "L1", 10, T0, T0 + 1_000, 2, T0)
    assert status == "stored"
    assert pool.deposit(st, "L1", 99, T0, T0 + 1_000, 2, T0) == ("replay", None)
    status, st2 = pool.deposit(st, "L2", 1, T0, T0 + 1_000, 2, T0)
    assert pool.deposit(st2, "L3", 1, T0, T0 + 1_000, 2, T0) == ("full", None)
    assert pool.deposit(st2, "L3", 1, T0, T0, 9, T0) == ("expired", None)
    got, st3 = pool.close(st2, "L1")
    assert got == (10, 0, True) and "L1" not in st3.entries
    assert pool.close(st3, "L1") == (None, None)
    # an entry of another incarnation (restored from an older state) closes as not current
    assert pool.close(st2, "L1", incarnation="ab12")[0] == (10, 0, False)


def test_pool_entries_of_another_incarnation_are_never_spendable():
    st = pool.PoolState({"old": PoolEntry(50, 10, T0 - 10, T0 + 1_000, "aa"),
                         "new": PoolEntry(5, 0, T0 - 10, T0 + 1_000, "bb")})
    assert pool.spendable(st, T0, "bb") == 5
    d, _ = pool.decide(st, PoolParams(6), T0, "bb")
    assert not d.allowed and d.remaining == 5
    d, new = pool.decide(st, PoolParams(5), T0, "bb")
    assert d.allowed and new.entries["old"].spent == 10  # the restored entry is untouched


def test_pool_take_buys_at_least_min_and_is_clamped_to_its_leases():
    st = pool.PoolState({"a": PoolEntry(5, 0, T0 - 10, T0 + 300), "b": PoolEntry(10, 0, T0 - 10, T0 + 2_000)})
    (taken, left, valid_for, _, debits), new = pool.take(st, 1, 8, T0)
    assert (taken, left, valid_for) == (8, 7, 300)  # the earliest-expiring lease first: valid 300 ms
    assert debits == (("a", 5), ("b", 3))  # what it took from each lease, in debit order
    (taken, left, _, _, debits), _ = pool.take(new, 7, 20, T0)
    assert (taken, left, debits) == (7, 0, (("b", 7),))  # partial: all that is left, since it is at least min
    assert pool.take(new, 8, 20, T0)[0][4] == ()  # nothing taken: no debits
    assert pool.take(new, 8, 20, T0)[0][0] == 0  # fewer than min: nothing taken


def test_pool_take_per_s_holds_no_more_than_the_first_lease_can_spend():
    """``per_s``: a chunk holds at most per_s tokens per second of the validity it gets (that of the
    earliest-expiring lease it is taken from), and at least min."""
    st = pool.PoolState({"a": PoolEntry(20, 0, T0 - 10, T0 + 300), "b": PoolEntry(50, 0, T0 - 10, T0 + 5_000)})
    assert pool.take(st, 1, 30, T0, per_s=20)[0][:3] == (6, 64, 300)  # 20/s x 0.3 s: 6 of a's 20
    assert pool.take(st, 1, 30, T0, per_s=1_000)[0][:3] == (30, 40, 300)  # no cap below want
    assert pool.take(st, 8, 30, T0, per_s=1)[0][:3] == (8, 62, 300)  # never below min
    assert pool.take(st, 1, 30, T0, per_s=20, waiting=11)[0][:3] == (11, 59, 300)  # nor the waiting requests
    assert pool.take(st, 1, 30, T0, per_s=20, waiting=50)[0][:3] == (30, 40, 300)  # never above want
    assert pool.take(st, 1, 30, T0)[0][:3] == (30, 40, 300)  # 0: no cap
    with pytest.raises(InvalidArguments):
        pool.take(st, 1, 30, T0, per_s=-1)


def test_sliding_log_cost_is_bounded():
    with pytest.raises(InvalidArguments):
        sliding_log.decide(None, WindowParams(5_000, 1_000, 1_001), T0, "m")
    with pytest.raises(InvalidArguments):  # refused where the script's SL.parse refuses it
        multi([None], [RuleSpec("sl", (5_000, 1_000, 1_001, 0, 0))], T0, "m")


@pytest.mark.parametrize(("unit", "lo", "want", "taken"), [
    (1, 1, 999, 999), (1, 1, 1_000, 1_000), (1, 1, 1_001, 1_000), (1, 1_000, 1_500, 1_000), (3, 1, 400, 333)])
def test_a_sliding_log_chunk_beyond_1000_entries_is_a_denied_count(unit, lo, want, taken):
    """As in ``lua/hot_chunk.lua``: a count whose entries pass 1,000 is beyond the log's range, so
    the search takes the largest count within it (the script's differential test compares both)."""
    rules = [RuleSpec("sl", (5_000, 60_000, unit, 0, 0))]
    reply, new = hot_chunk.take([None], rules, T0, "C", lo, want)
    assert reply[0] == taken and new is not None and len(new[0].entries) == taken * unit
    with pytest.raises(InvalidArguments):  # min units beyond the range: the script's error reply
        hot_chunk.take([None], rules, T0, "C", 1_001, 1_001)


def test_multi_rule_validation():
    tb = RuleSpec("tb", (1, 1, 1, 1, 0))
    with pytest.raises(InvalidArguments):
        multi([None] * 9, [tb] * 9, T0, "m")
    with pytest.raises(InvalidArguments):
        multi([None], [RuleSpec("leaky", (1, 1, 1, 1, 0))], T0, "m")
    with pytest.raises(InvalidArguments):
        multi([None], [RuleSpec("sl", (1, 1, 1, 0, 0))], T0, "")
    with pytest.raises(InvalidArguments):
        multi([None, None], [tb, RuleSpec("tb", (1, 0, 1, 1, 0))], T0, "m")
