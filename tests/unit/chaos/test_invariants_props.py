"""Properties of the executable invariants: a reference allocator that never over-grants and
regions that never over-spend always pass; one extra token anywhere is always caught."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import invariants as inv
from chaos.invariants import DecisionRecord, GrantRecord, PoolPolicy, SpendRecord

W = 1_000
G = 50
POOLS = [PoolPolicy(id="p", limit=G, window_ms=W, fallback_per_region=5)]

requests = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["eu", "us", "ap"]), st.integers(1, 20)),
                    min_size=1, max_size=40)


def allocate(reqs: list[tuple[int, str, int]]) -> list[GrantRecord]:
    """A correct allocator: give min(want, remaining) per window."""
    remaining: dict[int, int] = {}
    out = []
    for n, (k, region, want) in enumerate(reqs):
        give = min(want, remaining.setdefault(k, G))
        remaining[k] -= give
        out.append(GrantRecord(lease_id=f"lease-{n:04d}", pool="p", region=region, granted=give, window_index=k,
                               epoch=1, ttl_ms=500, sent_at_ms=k * W, window_end_ms=(k + 1) * W,
                               commit_revision=2 + n))
    return out


def spend_all(grants: list[GrantRecord]) -> tuple[list[SpendRecord], list[DecisionRecord]]:
    spends = [SpendRecord(g.lease_id, g.granted, at_ms=g.window_index * W + 100) for g in grants if g.granted]
    decisions = [DecisionRecord(pool="p", window_index=g.window_index, region=g.region, allowed=True,
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
    # a window admitted more than G + the fallback allowance of the regions that used it
    full = [w for w in inv.admitted_within_bound(decisions, POOLS).windows if w.admitted == G]
    if full:
        k = full[0].window_index
        extra = [DecisionRecord(pool="p", window_index=k, region="eu", allowed=True, tokens=5, fallback=True),
                 DecisionRecord(pool="p", window_index=k, region="us", allowed=True, tokens=1)]
        check = inv.admitted_within_bound(decisions + extra, POOLS)
        assert [(v.window_index, v.observed, v.bound) for v in check.violations] == [(k, G + 6, G + 5)]
        assert check.worst is not None and check.worst.excess == 1
