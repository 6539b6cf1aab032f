"""Placing this process on the allocator's clock (docs/bound.md): pool windows as the allocator
numbers them, with the round trip's uncertainty; near a boundary both windows are candidates."""

from region_agent.leasing.window_clock import MAX_DRIFT, AllocatorClock

W = 1_000


def test_before_any_grant_the_wall_clock_stands_in_with_its_uncertainty():
    c = AllocatorClock(unknown_offset_ms=200)
    assert not c.known
    w = c.windows(W, mono_ms=5.0, wall_ms=10_500.0)  # allocator time in [10,300, 10,700]
    assert (w.lo, w.hi) == (10, 10) and w.end_in_ms == 700 and w.safe_ms == 300
    w = c.windows(W, mono_ms=5.0, wall_ms=10_900.0)  # [10,700, 11,100]: both windows
    assert (w.lo, w.hi, w.span) == (10, 11, 2)


def test_a_grant_bounds_the_offset_by_its_round_trip():
    c = AllocatorClock(unknown_offset_ms=5_000)
    # sent at mono 1,000, answered at 1,040; the leader decided at its 50,020
    c.observe(sent_mono_ms=1_000, received_mono_ms=1_040, issued_at_ms=50_020)
    assert c.known and (c.lo, c.hi) == (48_980, 49_020)
    assert c.bounds(1_040, wall_ms=0) == (50_020, 50_060)  # the wall clock no longer matters
    w = c.windows(W, mono_ms=1_500, wall_ms=0)  # allocator time in [50,480, 50,520]
    assert (w.lo, w.hi) == (50, 50)
    w = c.windows(W, mono_ms=1_970, wall_ms=0)  # [50,950, 50,990], widened by 0.93 ms of drift (930 ms old)
    assert (w.lo, w.hi) == (50, 50) and w.safe_ms == 9 and w.end_in_ms == 51
    w = c.windows(W, mono_ms=1_990, wall_ms=0)  # [50,970, 51,010]: straddles the boundary
    assert (w.lo, w.hi) == (50, 51)


def test_uncertainty_widens_with_age_and_a_new_grant_replaces_the_old_view():
    c = AllocatorClock()
    c.observe(0, 10, 1_000)
    lo, hi = c.bounds(10 + 100_000, 0)
    assert hi - lo == 10 + 2 * MAX_DRIFT * 100_000
    c.observe(200_000, 200_004, 9_000_000)  # another leader, another clock
    assert (c.lo, c.hi) == (9_000_000 - 200_004, 9_000_000 - 200_000)


def test_an_answer_received_before_it_was_sent_is_ignored():
    c = AllocatorClock()
    c.observe(100, 50, 1)
    assert not c.known
