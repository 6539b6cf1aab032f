"""Properties of the executable invariants: a reference allocator that never over-grants and
regions that never over-spend always pass; one extra token anywhere is always caught."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import invariants as inv
from chaos.invariants import GrantSighting, PoolAdmission, PoolPolicy, SpendRecord
from kernel.bound import Faults, Topology

W = 1_000
G = 50
POOLS = [PoolPolicy(id="p", limit=G, window_ms=W, fallback_per_region=5)]
TOPO = Topology(agents={"eu": 1, "us": 1, "ap": 1})


def EU_CUT(pool: str, index: int) -> Faults:  # noqa: N802 - a constant-like fault function
    return Faults(allocator_unreachable=frozenset({"eu"}))

requests = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["eu", "us", "ap"]), st.integers(1, 20)),
                    min_size=1, max_size=40)


def allocate(reqs: list[tuple[int, str, int]]) -> list[GrantSighting]:
    """A correct allocator: give min(want, remaining) per window."""
    remaining: dict[int, int] = {}
    out = []
    for n, (k, region, want) in enumerate(reqs):
        give = min(want, remaining.setdefault(k, G))
        remaining[k] -= give
        out.append(GrantSighting(lease_id=f"lease-{n:04d}", pool="p", region=region, granted=give, window_index=k,
                               epoch=1, ttl_ms=500, sent_at_ms=k * W, window_end_ms=(k + 1) * W,
                               commit_revision=2 + n))
    return out


def spend_all(grants: list[GrantSighting]) -> tuple[list[SpendRecord], list[PoolAdmission]]:
    spends = [SpendRecord(g.lease_id, g.granted, at_ms=g.window_index * W + 100) for g in grants if g.granted]
    decisions = [PoolAdmission(pool="p", window_index=g.window_index, region=g.region, allowed=True,
                                tokens=g.granted, lease_id=g.lease_id) for g in grants if g.granted]
    return spends, decisions


@settings(max_examples=60, deadline=None)
@given(requests)
def test_correct_allocation_and_spending_pass_every_invariant(reqs):
    grants = allocate(reqs)
    spends, decisions = spend_all(grants)
    assert inv.granted_within_limit(grants, POOLS) == []
    assert inv.no_double_grant(grants + grants) == []
    assert inv.no_stale_epoch_commit(grants, []) == []
    assert inv.lease_spend_within_grant(spends, grants) == []
    assert inv.no_spend_after_expiry(spends, grants, 0) == []
    assert inv.acknowledged_grants_persisted(grants, grants) == []
    check = inv.admitted_within_bound(decisions, POOLS)
    assert check.violations == [] and all(w.admitted <= G for w in check.windows)


@settings(max_examples=60, deadline=None)
@given(requests, st.data())
def test_one_extra_token_is_always_caught(reqs, data):
    grants = allocate(reqs)
    spends, decisions = spend_all(grants)
    i = data.draw(st.integers(0, len(grants) - 1))
    g = grants[i]
    # the lease spends one token more than it was granted
    over = spends + [SpendRecord(g.lease_id, 1, at_ms=g.window_index * W + 200)]
    assert [v.lease_id for v in inv.lease_spend_within_grant(over, grants)] == [g.lease_id]
    # etcd lost the grant a region acknowledged (only non-zero grants are acknowledged)
    lost = inv.acknowledged_grants_persisted(grants, grants[:i] + grants[i + 1:])
    assert [v.lease_id for v in lost] == ([g.lease_id] if g.granted else [])
    # a window admitted more than G + the fallback allowance of the region cut off from the allocator
    full = [w for w in inv.admitted_within_bound(decisions, POOLS).windows if w.admitted == G]
    if full:
        k = full[0].window_index
        extra = [PoolAdmission(pool="p", window_index=k, region="eu", allowed=True, tokens=5, fallback=True),
                 PoolAdmission(pool="p", window_index=k, region="us", allowed=True, tokens=1)]
        check = inv.admitted_within_bound(decisions + extra, POOLS, EU_CUT, TOPO)
        assert [(v.window_index, v.observed, v.bound) for v in check.violations] == [(k, G + 6, G + 5)]
        assert check.worst is not None and check.worst.excess == 1
        # the same 5 fallback tokens without the fault that allows them: the region broke its promise
        check = inv.admitted_within_bound(decisions + extra[:1], POOLS, None, TOPO)
        assert (k, 5, 0) in [(v.window_index, v.observed, v.bound) for v in check.violations]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=300),
       st.integers(0, 5))
def test_attribution_finds_a_fitting_assignment_when_one_exists_and_fails_when_none_does(tokens, k_over):
    """Each token has a true window (never more than G per window) and is recorded with candidate
    windows around it: the check must pass. One token more than every window can hold fails."""
    per: dict[int, int] = {}
    decisions = []
    for true, before, after in tokens:
        if per.get(true, 0) >= G:
            continue
        per[true] = per.get(true, 0) + 1
        decisions.append(PoolAdmission(pool="p", window_index=max(0, true - before), region="eu", allowed=True,
                                        last_window=true + after if (before or after) else None))
    assert inv.admitted_within_bound(decisions, POOLS, None, TOPO).violations == []
    # fill every window 0..6 to G with certain admissions, then one more token that may land anywhere in 0..6
    full = [PoolAdmission(pool="p", window_index=k, region="eu", allowed=True, tokens=G) for k in range(7)]
    loose = PoolAdmission(pool="p", window_index=0, region="eu", allowed=True, last_window=6)
    assert inv.admitted_within_bound(full, POOLS, None, TOPO).violations == []
    assert inv.admitted_within_bound(full + [loose], POOLS, None, TOPO).violations
    shifted = PoolAdmission(pool="p", window_index=k_over, region="eu", allowed=True, last_window=k_over + 1)
    assert inv.admitted_within_bound(full + [shifted], POOLS, None, TOPO).violations


@given(limit=st.integers(1, 10_000), admitted=st.integers(0, 12_000), demand=st.integers(0, 30_000),
       touched=st.sampled_from(["", "partition on eu->allocator"]))
def test_fault_free_utilisation_judges_exactly_untouched_windows_with_demand_above_g(
        limit: int, admitted: int, demand: int, touched: str) -> None:
    """A window is flagged iff nothing touched it, its demand exceeded G and it admitted less than
    ceil(0.97 x G); the violation names the floor it missed."""
    u = inv.Utilisation("p", 7, admitted, max(demand, admitted), limit, touched)
    got = inv.fault_free_utilisation([u])
    need = -(-limit * 97 // 100)
    expect = not touched and max(demand, admitted) > limit and admitted < need
    assert bool(got) == expect
    if got:
        assert (got[0].observed, got[0].bound, got[0].window_index) == (admitted, need, 7)
