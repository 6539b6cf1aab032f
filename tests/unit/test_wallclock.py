"""tests/wallclock.py: how long a real-time test waits to be clear of a window's edges."""

from tests.wallclock import edge_wait_s

W = 60_000


def test_inside_the_window_there_is_no_wait():
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 1_500) == 0.0
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 45_000) == 0.0


def test_in_the_tail_it_waits_into_the_next_window():
    wait = edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 50_000)
    assert 5 * W + 50_000 + wait * 1000 >= 6 * W + 1_500
    assert wait < 12  # not a window more


def test_at_the_start_it_waits_for_after_ms():
    assert edge_wait_s(W, before_ms=15_000, after_ms=1_500, now_ms=5 * W + 500) == 1.0
    assert edge_wait_s(W, before_ms=15_000, now_ms=5 * W) == 0.0
