"""The worked numbers of docs/invariants.md through the pure reference models."""

from kernel.algorithms import (
    concurrency,
    fixed_window,
    gcra,
    sliding_counter,
    sliding_log,
    token_bucket,
)
from kernel.algorithms.concurrency import ConcurrencyParams
from kernel.algorithms.fixed_window import FixedWindowState, WindowParams
from kernel.algorithms.gcra import GcraState
from kernel.algorithms.multi_rule import RuleSpec
from kernel.algorithms.multi_rule import decide as multi
from kernel.algorithms.sliding_counter import SlidingCounterState
from kernel.algorithms.sliding_log import SlidingLogState
from kernel.algorithms.token_bucket import TokenBucketParams, TokenBucketState

P_READ = TokenBucketParams(20_000, 2_000, 1_000, 1_000)
T0 = 1_700_000_000_000


def drain(state, params, now, n, mod=token_bucket):
    out = []
    for _ in range(n):
        d, new = mod.decide(state, params, now)
        out.append(d)
        state = new if new is not None else state
    return out, state


def test_p_read_timeline():
    ds, st = drain(None, P_READ, T0, 20)
    assert all(d.allowed for d in ds) and ds[-1].remaining == 0
    d, new = token_bucket.decide(st, P_READ, T0)
    assert d.as_reply() == [0, 0, 500] and new is None
    d, _ = token_bucket.decide(st, P_READ, T0 + 300)
    assert d.as_reply() == [0, 600, 200]
    ds, after = drain(st, P_READ, T0 + 5_000, 11)
    assert [d.allowed for d in ds] == [True] * 10 + [False]
    d, _ = token_bucket.decide(st, P_READ, T0 + 10_000)
    assert d.remaining == 19_000
    d, _ = token_bucket.decide(st, P_READ, T0 + 60_000)
    assert d.remaining == 19_000  # capped at 20 tokens, minus this request
    assert token_bucket.expiry_ms(P_READ, 5_000) == 15_000



def test_p_read_admits_its_burst_plus_its_rate():
    """docs/invariants.md I4: over 10 s a full P-READ bucket admits capacity + rate x T = 20 + 2 x 10
    = 40 requests (a request every 50 ms from t = 0 to t = 10 s), twice a strict 20-per-10-s window."""
    state, admitted = None, []
    for t in range(0, 10_001, 50):
        d, new = token_bucket.decide(state, P_READ, T0 + t)
        state = new if new is not None else state
        if d.allowed:
            admitted.append(t)
    assert len(admitted) == 40
    assert admitted[:20] == [t * 50 for t in range(20)]  # the burst: the first 20 in a row
    assert len([t for t in admitted if t < 10_000]) == 39 and admitted[-1] == 10_000

def test_weighted_export_retry():
    export = TokenBucketParams(20_000, 2_000, 1_000, 10_000)
    d, new = token_bucket.decide(TokenBucketState(3_000, T0), export, T0)
    assert d.as_reply() == [0, 3_000, 3_500] and new is None


def test_multi_rule_walkthrough():
    user = RuleSpec("tb", (20_000, 2_000, 1_000, 1_000, 0))
    tenant = RuleSpec("tb", (1_000_000, 1_000_000, 60_000, 1_000, 0))
    d, new = multi([TokenBucketState(1_000, T0), TokenBucketState(639_000, T0)], [user, tenant], T0, "D1")
    assert d.as_reply() == [1, 0, 0, 0, 638_000]
    assert new == [TokenBucketState(0, T0), TokenBucketState(638_000, T0)]
    d, new = multi([TokenBucketState(0, T0), TokenBucketState(639_000, T0)], [user, tenant], T0, "D1")
    assert d.as_reply() == [0, 1, 500, 0, 639_000] and new is None
    heavy = RuleSpec("tb", (1_000_000, 1_000_000, 60_000, 10_000, 0))
    user10 = RuleSpec("tb", (20_000, 2_000, 1_000, 10_000, 0))
    d, new = multi([TokenBucketState(20_000, T0), TokenBucketState(3_000, T0)], [user10, heavy], T0, "D1")
    assert d.as_reply()[:3] == [0, 2, 420] and d.remaining[0] == 20_000 and new is None


def test_multi_rule_never_wins_and_max_retry():
    a = RuleSpec("tb", (20_000, 2_000, 1_000, 1_000, 0))
    b = RuleSpec("tb", (1_000, 1_000, 1_000, 5_000, 0))  # cost > capacity
    d, _ = multi([TokenBucketState(0, T0), None], [a, b], T0, "D")
    assert (d.denied_by, d.retry_after_ms) == (1, -1)
    c = RuleSpec("fw", (1, 10_000, 1, 0, 0))
    d, _ = multi([TokenBucketState(0, T0), FixedWindowState(T0 - T0 % 10_000, 1)], [a, c], T0, "D")
    assert d.denied_by == 1 and d.retry_after_ms == max(500, 10_000 - T0 % 10_000)


def test_fixed_window_boundary():
    p = WindowParams(20, 10_000)
    base = 1_700_000_000_000 - 1_700_000_000_000 % 10_000
    st = None
    for i in range(20):
        d, st2 = fixed_window.decide(st, p, base + i * 400)
        assert d.allowed
        st = st2
    d, new = fixed_window.decide(st, p, base + 9_900)
    assert d.as_reply() == [0, 0, 100] and new is None
    ds, _ = drain(st, p, base + 10_100, 21, fixed_window)
    assert [d.allowed for d in ds] == [True] * 20 + [False]
    assert fixed_window.expiry_ms(FixedWindowState(base, 1), p, base + 9_900, 2_000) == 2_100


def test_sliding_log_retry_hint():
    p = WindowParams(20, 10_000)
    st = SlidingLogState({f"r{i}": 1_000 for i in range(20)})
    d, new = sliding_log.decide(st, p, 1_000, "r21")
    assert d.as_reply() == [0, 0, 10_000] and new is None
    d, new = sliding_log.decide(st, p, 1_000, "r3")  # replay of an admitted id
    assert d.allowed and new is None
    d, new = sliding_log.decide(st, p, 11_000, "r21")  # all 20 left the window (now - W, now]
    assert d.as_reply() == [1, 19, 0] and set(new.entries) == {"r21"}


def test_sliding_log_weighted_cost_entries():
    p = WindowParams(5, 1_000, 3)
    d, new = sliding_log.decide(None, p, 10, "x")
    assert d.as_reply() == [1, 2, 0] and set(new.entries) == {"x", "x#2", "x#3"}
    d, _ = sliding_log.decide(new, p, 20, "y")
    assert d.as_reply() == [0, 2, 990]  # one of x's entries must leave: at 10 + 1000


def test_sliding_counter_seed_case():
    p = WindowParams(20, 10_000)
    w = 1_700_000_000_000
    d, new = sliding_counter.decide(SlidingCounterState(w, 5, 18), p, w + 2_500)
    assert d.allowed and d.remaining == 0 and new == SlidingCounterState(w, 6, 18)
    # 18*7,500 + 6*10,000 + 10,000 = 205,000 > 200,000: denied, retry when prev has decayed enough
    d, _ = sliding_counter.decide(new, p, w + 2_500)
    assert not d.allowed and d.retry_after_ms == 278  # ceil(5,000 / 18)
    # the rolled-over previous window: stored w one window back becomes prev
    d, rolled = sliding_counter.decide(SlidingCounterState(w - 10_000, 18, 3), p, w + 2_500)
    assert d.allowed and rolled == SlidingCounterState(w, 1, 18)


def test_gcra_worked_numbers():
    d_prev = None
    st = None
    for _ in range(20):
        d_prev, st = gcra.decide(st, P_READ, T0)
    assert d_prev.allowed and st == GcraState(T0 + 10_000)
    d, new = gcra.decide(st, P_READ, T0)
    assert d.as_reply() == [0, 0, 500] and new is None
    d, new = gcra.decide(st, P_READ, T0 + 5_000)
    assert d.allowed and new.tat - (T0 + 5_000) == 5_500 and d.remaining == 9_000


def test_concurrency_fourth_export_denied():
    p = ConcurrencyParams(3, 60_000)
    st = None
    for i in range(3):
        d, st = concurrency.acquire(st, p, T0, f"E{i}")
        assert d.allowed
    d, new = concurrency.acquire(st, p, T0, "E3")
    assert (int(d.allowed), d.remaining) == (0, 3) and new is None
    d, new = concurrency.acquire(st, p, T0, "E1")  # idempotent re-acquire
    assert d.allowed and d.remaining == 3 and new is None
    released, n, st2 = concurrency.release(st, T0, "E0")
    assert (released, n) == (True, 2)
    assert concurrency.release(st2, T0, "E0")[:2] == (False, 2)
    released, n, st3 = concurrency.release(st, T0 + 60_000, "E1")  # expired: removed, but it held nothing
    assert (released, n) == (False, 0) and st3 is not None and "E1" not in st3.slots
    d, _ = concurrency.acquire(st, p, T0 + 60_000, "E3")  # all three expired at T0 + 60 s
    assert d.allowed and d.remaining == 1
