"""Property: every finite retry hint is exact — the same request is admitted at now + retry and
still denied one millisecond earlier (no other traffic). Ceilings make hints never optimistic."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.algorithms import fixed_window, gcra, sliding_counter, sliding_log, token_bucket
from kernel.algorithms.fixed_window import FixedWindowState, WindowParams
from kernel.algorithms.gcra import GcraState
from kernel.algorithms.sliding_counter import SlidingCounterState
from kernel.algorithms.sliding_log import SlidingLogState
from kernel.algorithms.token_bucket import TokenBucketParams, TokenBucketState

NOW = 1_700_000_000_123
FAST = settings(max_examples=300, deadline=None)


def assert_exact(decide, state, now, minimal=True):
    d, _ = decide(state, now)
    if d.allowed or d.retry_after_ms < 0:
        return
    r = d.retry_after_ms
    assert r >= 1
    assert decide(state, now + r)[0].allowed, r
    if minimal:
        assert not decide(state, now + r - 1)[0].allowed, r


@FAST
@given(cap=st.integers(1, 10**6), refill=st.integers(1, 10**5), period=st.integers(1, 10**5),
       cost=st.integers(1, 10**6), tokens=st.integers(0, 10**6), ago=st.integers(-10**4, 10**6))
def test_token_bucket_and_gcra_hints(cap, refill, period, cost, tokens, ago):
    p = TokenBucketParams(cap, refill, period, min(cost, cap))
    # the bucket's hint ceil(deficit x period / refill) ignores the sub-millitoken progress
    # already made since ts, and counts from now even when ts is ahead (clock went back): it is
    # sound (never optimistic) for ts <= now, not always minimal
    if ago >= 0:
        assert_exact(lambda s, n: token_bucket.decide(s, p, n), TokenBucketState(tokens, NOW - ago), NOW,
                     minimal=False)
    assert_exact(lambda s, n: gcra.decide(s, p, n), GcraState(NOW + ago), NOW)


@FAST
@given(limit=st.integers(1, 50), window=st.integers(1, 10**5), cost=st.integers(1, 50), n=st.integers(0, 60),
       cur=st.integers(0, 60), prev=st.integers(0, 60), back=st.integers(-3, 3))
def test_window_hints(limit, window, cost, n, cur, prev, back):
    p = WindowParams(limit, window, min(cost, limit))
    w = NOW - NOW % window + back * window
    assert_exact(lambda s, t: fixed_window.decide(s, p, t), FixedWindowState(w, n), NOW)
    assert_exact(lambda s, t: sliding_counter.decide(s, p, t), SlidingCounterState(w, cur, prev), NOW)


@FAST
@given(limit=st.integers(1, 8), window=st.integers(1, 10**4), cost=st.integers(1, 8),
       ages=st.lists(st.integers(-500, 12_000), max_size=12))
def test_sliding_log_hint(limit, window, cost, ages):
    p = WindowParams(limit, window, min(cost, limit))
    state = SlidingLogState({f"m{i}": NOW - a for i, a in enumerate(ages)})
    assert_exact(lambda s, t: sliding_log.decide(s, p, t, "new"), state, NOW)
