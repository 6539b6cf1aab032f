"""The allocation policy, with the clock passed in: demand-weighted chunk, fair share, partial
tail, clamping to the window end, prefetch rules, reclaim; ``sum(granted) <= G`` after every
step of randomized sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import allocation
from kernel.bundle import Pool
from kernel.errors import Conflict, Forbidden, ValidationFailed

W = 60_000
T0 = 1_000 * W  # start of window 1000


def mkpool(**kw: object) -> Pool:
    base: dict[str, object] = dict(id="p", window_ms=W, limit=1_000, lease_ttl_ms=15_000, chunk_min=10,
                                   chunk_max=100, prefetch_ms=2_000, active_horizon_ms=10_000)
    base.update(kw)
    return Pool(**base)  # type: ignore[arg-type]  # the test passes any field; Pool checks them


def check_invariant(state: allocation.WindowState) -> None:
    assert 0 <= state.remaining <= state.limit
    assert state.total_granted - state.total_returned == state.limit - state.remaining
    assert state.total_granted - state.total_returned <= state.limit


def test_window_index_and_bounds() -> None:
    assert allocation.window_index(T0 + 59_999, W) == 1000
    assert allocation.window_index(T0 + 60_000, W) == 1001
    ref = allocation.window_ref(1000, W)
    assert (ref.start_ms, ref.end_ms) == (T0, T0 + W)


def test_demand_weighted_chunk_follows_demand_within_bounds() -> None:
    pool = mkpool()
    assert allocation.demand_chunk(pool, 0) == 100  # no signal yet: the maximum chunk
    assert allocation.demand_chunk(pool, 1) == 15  # 1 token/s over a 15 s lease
    assert allocation.demand_chunk(pool, 4) == 60
    assert allocation.demand_chunk(pool, 1_000) == 100  # capped at chunkMax
    assert allocation.demand_chunk(mkpool(chunk_min=30), 1) == 30  # floored at chunkMin
    assert allocation.demand_chunk(pool, 4, life_ms=3_000) == 12  # a lease clamped to 3 s of life: 3 s of demand
    assert allocation.demand_chunk(pool, 4, life_ms=60_000) == 60  # never more than the TTL's
    assert allocation.demand_chunk(pool, 4, life_ms=0) == 10  # chunkMin still


def test_a_lease_near_the_window_end_holds_what_the_region_can_spend_by_then() -> None:
    """Tokens left in a lease at its window's end are stranded (unspendable by anyone): a lease whose
    expiry is clamped to the end is sized by the demand over its real life, not over the TTL."""
    pool = mkpool(chunk_max=1_000)
    s = allocation.new_window(pool, 1000)
    early = allocation.decide_grant(pool, s, region="eu", want=1_000, demand=20, now_ms=T0 + 1_000)
    assert early.granted == 300  # 20 tokens/s x 15 s
    late = allocation.decide_grant(pool, s, region="eu", want=1_000, demand=20, now_ms=T0 + W - 2_000)
    assert (late.granted, late.ttl_ms) == (40, 2_000)  # 20 tokens/s x the 2 s left
    nxt = allocation.new_window(pool, 1001)  # a prefetched lease lives from its window's start
    pre = allocation.decide_grant(pool, nxt, region="eu", want=1_000, demand=20, now_ms=T0 + W - 1_000)
    assert pre.starts_in_ms == 1_000 and pre.granted == 300


def test_grant_gives_min_of_want_chunk_and_remaining() -> None:
    pool = mkpool()
    s = allocation.new_window(pool, 1000)
    d = allocation.decide_grant(pool, s, region="eu", want=40, demand=0, now_ms=T0 + 1_000)
    assert d.granted == 40 and s.remaining == 960
    d = allocation.decide_grant(pool, s, region="eu", want=500, demand=2, now_ms=T0 + 2_000)
    assert d.granted == 30  # chunk for 2 tokens/s x 15 s
    assert s.granted == {"eu": 70} and s.leases == {"eu": 2}
    check_invariant(s)


def test_expiry_is_clamped_to_the_window_end() -> None:
    pool = mkpool()
    s = allocation.new_window(pool, 1000)
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=0, now_ms=T0 + 50_000)
    assert d.expires_at_ms == T0 + W  # 0:50 + 15 s would be 1:05; clamped to 1:00
    assert d.ttl_ms == 10_000 and d.starts_in_ms == 0
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=0, now_ms=T0 + 1_000)
    assert d.expires_at_ms == T0 + 16_000 and d.ttl_ms == 15_000


def test_prefetch_only_shortly_before_the_boundary() -> None:
    pool = mkpool()
    with pytest.raises(Conflict, match="prefetch"):
        allocation.target_window(pool, "next", T0 + 50_000)
    assert allocation.target_window(pool, "next", T0 + 58_500) == 1001
    assert allocation.target_window(pool, "current", T0 + 58_500) == 1000
    s = allocation.new_window(pool, 1001)
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=0, now_ms=T0 + 58_500)
    assert d.window.index == 1001
    assert d.starts_in_ms == 1_500
    assert d.expires_at_ms == T0 + W + 15_000
    assert d.ttl_ms == d.expires_at_ms - (T0 + 58_500)


def test_prefetch_expiry_clamped_to_next_window_end() -> None:
    pool = mkpool(window_ms=10_000, lease_ttl_ms=15_000, prefetch_ms=2_000)
    now = 100 * 10_000 - 1_000
    s = allocation.new_window(pool, 100)
    d = allocation.decide_grant(pool, s, region="eu", want=5, demand=0, now_ms=now)
    assert d.expires_at_ms == 101 * 10_000  # min(start + 15 s, end of window 100)


def test_fair_share_when_low_and_partial_tail() -> None:
    pool = mkpool(limit=260, chunk_max=100, chunk_min=1)
    s = allocation.new_window(pool, 1000)
    now = T0 + 1_000
    assert allocation.decide_grant(pool, s, region="eu", want=100, demand=50, now_ms=now).granted == 100
    # 160 left, 2 active regions with equal demand: low (160 < 100 x 2) -> half each
    assert allocation.decide_grant(pool, s, region="us", want=100, demand=50, now_ms=now).granted == 80
    assert allocation.decide_grant(pool, s, region="eu", want=100, demand=50, now_ms=now).granted == 40
    assert allocation.decide_grant(pool, s, region="us", want=100, demand=50, now_ms=now).granted == 20
    # the tail keeps being shared, one token at least, until nothing is left
    total = 240
    for _ in range(40):
        total += allocation.decide_grant(pool, s, region="eu", want=100, demand=50, now_ms=now).granted
        check_invariant(s)
    assert total == 260 and s.remaining == 0
    check_invariant(s)


def test_sixty_token_remainder_is_granted_partially() -> None:
    pool = mkpool(limit=1_000, chunk_max=100, chunk_min=10)
    s = allocation.new_window(pool, 1000)
    s.remaining, s.granted = 60, {"eu": 940}
    d = allocation.decide_grant(pool, s, region="eu", want=100, demand=0, now_ms=T0)
    assert d.granted == 60 and d.remaining == 0  # a partial grant below chunkMin, not a refusal


def test_fair_share_weighted_by_demand() -> None:
    pool = mkpool(limit=300, chunk_max=100, chunk_min=1)
    s = allocation.new_window(pool, 1000)
    now = T0 + 1_000
    s.remaining = 100
    s.granted = {"x": 200}
    s.active = {"us": allocation.RegionActivity(last_ms=now, demand=10)}
    s.spent = {"eu": 15}  # eu demonstrably spent 15 tokens in the window's first second: 30/s is credible
    d = allocation.decide_grant(pool, s, region="eu", want=100, demand=30, now_ms=now)
    assert d.granted == 75  # 100 x 30 / (30 + 10)
    check_invariant(s)


def test_a_demand_claim_counts_only_as_far_as_reported_spending_supports_it() -> None:
    pool = mkpool(limit=300, chunk_max=100, chunk_min=1)  # floor: 100 tokens per 15 s = 7 tokens/s
    assert allocation.demand_floor(pool) == 7
    s = allocation.new_window(pool, 1000)
    now = T0 + 10_000
    s.remaining, s.granted = 100, {"eu": 100, "us": 100}
    s.active = {"eu": allocation.RegionActivity(last_ms=now, demand=5)}
    # no history: a claim of a billion tokens/s counts as the floor, and takes 7/12 of the tail, not all
    d = allocation.decide_grant(pool, s, region="us", want=100, demand=10**9, now_ms=now)
    assert d.granted == 100 * 7 // (7 + 5) and s.active["us"].demand == 7
    check_invariant(s)
    # spending shown by usage reports (this window and the one before) makes a claim credible, up to 2x
    prev = allocation.new_window(pool, 999)
    prev.spent = {"us": 600}  # 600 tokens over the 70 s since window 999 started: 9 tokens/s
    assert allocation.spend_rate(s, prev, pool, "us", now) == 9
    assert allocation.credible_demand(pool, s, prev, region="us", demand=10**9, now_ms=now) == 18
    assert allocation.credible_demand(pool, s, prev, region="us", demand=12, now_ms=now) == 12  # within: as claimed
    assert allocation.credible_demand(pool, s, None, region="us", demand=0, now_ms=now) == 0  # no signal stays 0
    s2 = s.copy()
    s2.active["us"] = allocation.RegionActivity(last_ms=now, demand=0)
    d = allocation.decide_grant(pool, s2, region="us", want=100, demand=10**9, now_ms=now, previous=prev)
    assert d.granted == (100 - 58) * 18 // (18 + 5)
    check_invariant(s2)


@settings(max_examples=150, deadline=None)
@given(remaining=st.integers(1, 300), others=st.lists(st.integers(0, 50), max_size=3),
       spent=st.integers(0, 5_000), claim=st.integers(1, 10**12))
def test_claims_beyond_the_evidence_change_nothing(remaining: int, others: list[int], spent: int, claim: int) -> None:
    """Whatever a region claims above its credible demand, it is granted exactly what claiming
    the credible demand gets: inflation buys nothing."""
    pool = mkpool(limit=1_000, chunk_max=100, chunk_min=1)
    now = T0 + 30_000

    def state() -> allocation.WindowState:
        s = allocation.new_window(pool, 1000)
        s.remaining, s.granted = remaining, {"x": 1_000 - remaining}
        s.spent = {"us": spent}
        s.active = {f"r{i}": allocation.RegionActivity(last_ms=now, demand=d) for i, d in enumerate(others)}
        return s

    cap = allocation.credible_demand(pool, state(), None, region="us", demand=claim, now_ms=now)
    assert cap <= claim and cap <= max(allocation.demand_floor(pool), 2 * allocation.spend_rate(state(), None, pool, "us", now))
    a, b = state(), state()
    inflated = allocation.decide_grant(pool, a, region="us", want=100, demand=claim, now_ms=now)
    honest = allocation.decide_grant(pool, b, region="us", want=100, demand=cap, now_ms=now)
    assert inflated.granted == honest.granted and a.remaining == b.remaining
    check_invariant(a)
    check_invariant(b)


def test_inactive_regions_do_not_hold_shares() -> None:
    pool = mkpool(limit=300, chunk_max=100, chunk_min=1, active_horizon_ms=10_000)
    s = allocation.new_window(pool, 1000)
    s.remaining = 80
    s.granted = {"us": 220}
    s.active = {"us": allocation.RegionActivity(last_ms=T0, demand=100)}
    d = allocation.decide_grant(pool, s, region="eu", want=80, demand=5, now_ms=T0 + 20_000)
    assert d.granted == 75  # chunk for 5/s, no fairness cap: us is no longer active


def test_tail_of_one_token_still_granted() -> None:
    pool = mkpool(limit=100, chunk_max=50, chunk_min=1)
    s = allocation.new_window(pool, 1000)
    s.remaining, s.granted = 1, {"x": 99}
    for r in ("a", "b", "c"):
        s.active[r] = allocation.RegionActivity(last_ms=T0, demand=100)
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=1, now_ms=T0)
    assert d.granted == 1 and s.remaining == 0 and d.exhausted_now
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=1, now_ms=T0)
    assert d.granted == 0 and d.remaining == 0 and not d.exhausted_now
    check_invariant(s)


def test_region_allow_list() -> None:
    pool = mkpool(regions=["eu"])
    s = allocation.new_window(pool, 1000)
    with pytest.raises(Forbidden):
        allocation.decide_grant(pool, s, region="us", want=1, demand=0, now_ms=T0)
    assert s.remaining == 1000


def test_reclaim_rules() -> None:
    with pytest.raises(ValidationFailed):
        allocation.decide_reclaim(granted=10, spent=11, expires_at_ms=T0, window_end_ms=T0 + W, now_ms=T0 + 1)
    with pytest.raises(Conflict, match="not yet expired"):
        allocation.decide_reclaim(granted=10, spent=1, expires_at_ms=T0 + 5, window_end_ms=T0 + W, now_ms=T0)
    d = allocation.decide_reclaim(granted=10, spent=3, expires_at_ms=T0, window_end_ms=T0 + W, now_ms=T0)
    assert (d.returned, d.stranded, d.window_open) == (7, 0, True)
    # a lease the region closed before expiry (an agent shutting down): returned at once
    d = allocation.decide_reclaim(granted=10, spent=3, expires_at_ms=T0 + 5, window_end_ms=T0 + W, now_ms=T0,
                              closed_early=True)
    assert (d.returned, d.stranded, d.window_open) == (7, 0, True)
    d = allocation.decide_reclaim(granted=10, spent=3, expires_at_ms=T0, window_end_ms=T0 + W, now_ms=T0 + W)
    assert (d.returned, d.stranded, d.window_open) == (0, 7, False)


step = st.tuples(
    st.sampled_from(["eu", "us", "ap", "sa"]),
    st.integers(min_value=1, max_value=400),  # want
    st.integers(min_value=0, max_value=200),  # demand
    st.integers(min_value=0, max_value=3_000),  # clock advance, ms
    st.integers(min_value=0, max_value=100),  # % of the lease spent if reported
)


@settings(max_examples=150, deadline=None)
@given(limit=st.integers(min_value=1, max_value=2_000), chunk_max=st.integers(min_value=1, max_value=300),
       steps=st.lists(step, min_size=1, max_size=60))
def test_random_sequences_never_overgrant(limit: int, chunk_max: int, steps: list[tuple]) -> None:
    chunk_max = min(chunk_max, limit)
    pool = mkpool(limit=limit, chunk_max=chunk_max, chunk_min=1)
    s = allocation.new_window(pool, 1000)
    now = T0
    leases: list[tuple[str, int, int]] = []  # region, granted, expires
    admitted = 0
    for region, want, demand, advance, pct in steps:
        now = min(now + advance, T0 + W - 1)
        d = allocation.decide_grant(pool, s, region=region, want=want, demand=demand, now_ms=now)
        assert 0 <= d.granted <= min(want, chunk_max)
        assert d.expires_at_ms <= T0 + W and d.ttl_ms == d.expires_at_ms - now
        if s.remaining + d.granted > 0:
            assert d.granted >= 1 or want == 0  # never stranding the tail: something while anything remains
        if d.granted:
            leases.append((region, d.granted, d.expires_at_ms))
        check_invariant(s)
        # report usage of expired leases: the unspent part returns, spent tokens stay admitted
        for lease in [x for x in leases if x[2] <= now]:
            leases.remove(lease)
            spent = lease[1] * pct // 100
            admitted += spent
            r = allocation.decide_reclaim(granted=lease[1], spent=spent, expires_at_ms=lease[2],
                                      window_end_ms=T0 + W, now_ms=now)
            allocation.apply_reclaim(s, lease[0], r.returned, lease[1], spent)
            check_invariant(s)
        assert sum(allocation.unreported_tokens(s).values()) == sum(x[1] for x in leases)
        # overshoot: admitted (reported) + what is still leased out never exceeds G
        assert admitted + sum(x[1] for x in leases) <= limit


@settings(max_examples=200, deadline=None)
@given(window_ms=st.integers(min_value=1_000, max_value=600_000), ttl=st.integers(min_value=100, max_value=900_000),
       prefetch=st.integers(min_value=0, max_value=999), now=st.integers(min_value=0, max_value=10**13),
       which=st.sampled_from(["current", "next"]))
def test_leases_never_outlive_their_window(window_ms: int, ttl: int, prefetch: int, now: int, which: str) -> None:
    pool = mkpool(window_ms=window_ms, lease_ttl_ms=min(ttl, 3_600_000), prefetch_ms=prefetch, limit=10,
                  chunk_max=10)
    try:
        k = allocation.target_window(pool, which, now)  # type: ignore[arg-type]  # "current" or "next", drawn as a plain str
    except Conflict:
        assert which == "next" and (now // window_ms + 1) * window_ms - now > prefetch
        return
    s = allocation.new_window(pool, k)
    d = allocation.decide_grant(pool, s, region="eu", want=5, demand=0, now_ms=now)
    assert d.window.start_ms <= now + d.starts_in_ms < d.expires_at_ms <= d.window.end_ms
    assert d.ttl_ms == d.expires_at_ms - now and d.ttl_ms - d.starts_in_ms <= pool.lease_ttl_ms
    assert (d.starts_in_ms > 0) == (which == "next")


def test_replay_keeps_the_grant_and_shrinks_relative_timings() -> None:
    pool = mkpool()
    s = allocation.new_window(pool, 1001)
    now = T0 + W - 1_500
    d = allocation.decide_grant(pool, s, region="eu", want=10, demand=0, now_ms=now)
    from kernel.wire import LeaseGrant
    g = LeaseGrant(lease_id="l-00000001", pool="p", region="eu", granted=d.granted, window=d.window,
                   expires_at_ms=d.expires_at_ms, ttl_ms=d.ttl_ms, starts_in_ms=d.starts_in_ms, epoch=7,
                   issued_at_ms=now, remaining=d.remaining)
    r = allocation.replay_view(g, now + 1_000)
    assert r.replayed and (r.granted, r.epoch, r.expires_at_ms, r.window) == (10, 7, g.expires_at_ms, g.window)
    assert r.ttl_ms == g.ttl_ms - 1_000 and r.starts_in_ms == 500
    late = allocation.replay_view(g, g.expires_at_ms + 5)
    assert late.ttl_ms == 0 and late.starts_in_ms == 0  # nothing left to spend
