"""The overshoot bound as one function (kernel.bound): the worked numbers of docs/bound.md, the
sample policy's, and every term's dependence on the topology and the faults."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kernel.bound import (
    CARRY,
    LOCAL,
    LOST,
    REGIONAL,
    Faults,
    PoolShape,
    Topology,
    bundle_bounds,
    pool_bound,
    shape_of,
)
from kernel.bundle import Pool, Rule, load_bundle_file, make_rule

REPO = Path(__file__).resolve().parents[3]
P_TENANT = PoolShape.plain("atlas-minute", 1_000, 60_000, 100, chunk_max=100)
TWO = Topology(agents={"eu": 1, "us": 1})


def test_worked_example_fallback_of_100_per_region_gives_1200() -> None:
    b = pool_bound(P_TENANT, TWO, Faults.allocator_only(TWO))
    assert b.total == 1_200 and b.overshoot == 200
    assert b.term(REGIONAL).tokens == 200 and b.term(CARRY).tokens == 0 and b.term(LOST).tokens == 0
    assert b.per_region == {"eu": 100, "us": 100}


def test_worked_example_unclamped_carry_over_of_a_100_chunk_per_region_gives_1200_clamped_gives_1000() -> None:
    no_fb = PoolShape.plain("atlas-minute", 1_000, 60_000, 0, chunk_max=100)
    assert pool_bound(no_fb, TWO, clamped=False).total == 1_200
    assert pool_bound(P_TENANT, TWO, Faults.allocator_only(TWO), clamped=False).total == 1_400
    # US cut off holding 200 unspent tokens, clamped leases, no fallback: overshoot 0 (200 stranded)
    cut_us = Faults(allocator_unreachable=frozenset({"us"}))
    assert pool_bound(no_fb, TWO, cut_us).total == 1_000
    assert pool_bound(P_TENANT, TWO, cut_us).total == 1_100  # only the cut-off region spends its fallback


def test_healthy_topology_promises_exactly_g() -> None:
    b = pool_bound(P_TENANT, Topology.uniform(5, 3))
    assert b.total == 1_000 and all(t.tokens == 0 for t in b.terms[1:])


def test_redis_loss_adds_f_per_agent_process_not_per_region() -> None:
    one = pool_bound(P_TENANT, TWO, Faults.worst(TWO))
    assert one.total == 1_000 + 2 * 100 + 2 * 100 and one.term(LOCAL).tokens == 200
    four = Topology.uniform(["eu", "us"], 2)
    b = pool_bound(P_TENANT, four, Faults.worst(four))
    assert b.total == 1_000 + 2 * 100 + 4 * 100 and b.per_region == {"eu": 300, "us": 300}
    # eu's Redis down for both its agents, one of which was restarted during the outage (3 processes)
    b = pool_bound(P_TENANT, four, Faults(redis_unreachable={"eu": 3}))
    assert b.total == 1_300 and b.per_region == {"eu": 300, "us": 0}


def test_sample_policy_numbers() -> None:
    bundle = load_bundle_file(REPO / "policies" / "northstar-global.json")
    healthy = {b.pool: b.total for b in bundle_bounds(bundle, TWO)}
    assert healthy == {"atlas-minute": 1_000, "birch-minute": 300, "global-read": 40_000}
    cut = {b.pool: b.total for b in bundle_bounds(bundle, TWO, Faults.allocator_only(TWO))}
    assert cut == {"atlas-minute": 1_200, "birch-minute": 360, "global-read": 48_000}
    worst = {b.pool: b.total for b in bundle_bounds(bundle, TWO, Faults.worst(TWO))}
    assert worst == {"atlas-minute": 1_400, "birch-minute": 420, "global-read": 56_000}
    four = Topology.uniform(["eu", "us"], 2)
    worst4 = {b.pool: b.total for b in bundle_bounds(bundle, four, Faults.worst(four))}
    assert worst4 == {"atlas-minute": 1_600, "birch-minute": 480, "global-read": 64_000}
    shapes = {b.pool: b for b in bundle_bounds(bundle, TWO)}
    assert shapes["global-read"].term(CARRY).tokens == 0


POOL = Pool(id="p", window_ms=1_000, limit=500, chunk_max=50, fallback_per_region=10)


def rule(rid: str, *, scope: str = "tenant", tenant: str | None = "atlas", fail: str = "local_bounded",
         shadow: bool = False) -> Rule:
    return make_rule(id=rid, scope=scope, algorithm="pool", pool="p", tenant=tenant, fail_mode=fail,
                shadow=shadow, route_group="read" if scope == "global" else None)


def test_shape_counts_balances_and_in_process_allowances_like_the_agent_keys_them() -> None:
    # a regional fallback window per balance (tenant tag, or the global tag); one in-process per pool
    s = shape_of(POOL, [rule("a"), rule("b", tenant="birch"), rule("g", scope="global", tenant=None)])
    assert (s.balances, s.local_keys, s.global_scope) == (3, 1, True)
    b = pool_bound(s, TWO, Faults.worst(TWO))
    assert b.total == 500 + 2 * 3 * 10 + 2 * 1 * 10
    # closed and shadow rules never spend an allowance
    s = shape_of(POOL, [rule("a"), rule("c", tenant="cedar", fail="closed"), rule("s", tenant="sh", shadow=True)])
    assert (s.balances, s.local_keys, s.global_scope) == (1, 1, False)


def test_tenant_pool_rule_without_a_tenant_is_unbounded_not_a_number() -> None:
    s = shape_of(POOL, [rule("any", tenant=None)])
    assert s.balances is None and s.local_keys == 1
    b = pool_bound(s, TWO, Faults.allocator_only(TWO))
    assert b.total is None and b.term(REGIONAL).tokens is None and b.per_region["eu"] is None
    assert pool_bound(s, TWO).total == 500  # healthy: still G
    assert pool_bound(s, TWO, Faults(redis_unreachable={"eu": 2})).total == 520  # in-process: per pool


def test_regions_that_may_not_lease_never_spend_the_regional_fallback() -> None:
    s = shape_of(Pool(id="p", window_ms=1_000, limit=500, fallback_per_region=10, regions=["eu"]), [rule("a")])
    b = pool_bound(s, TWO, Faults.worst(TWO))
    assert b.term(REGIONAL).tokens == 10 and b.term(LOCAL).tokens == 20 and b.per_region == {"eu": 20, "us": 10}


def test_uniform_topology_names_and_rejects_empty() -> None:
    assert Topology.uniform(2, 3).agents == {"region-1": 3, "region-2": 3}
    with pytest.raises(ValueError):
        Topology.uniform(0)
    with pytest.raises(ValueError):
        Topology.uniform(["eu"], 0)


# ------------------------------------------------------------------------------ RLQS (Envoy quota)
def test_rlqs_term_is_zero_for_clamped_windows_and_deny_all_envoys() -> None:
    from kernel.bound import RLQS, RlqsShape

    rlqs = RlqsShape(envoys={"eu": 2, "us": 1}, buckets=40, max_assignment=100)
    healthy = pool_bound(P_TENANT, TWO, rlqs=rlqs)
    assert healthy.term(RLQS).tokens == 0 and healthy.total == 1_000
    cut = pool_bound(P_TENANT, TWO, Faults(envoys_cut_off={"eu": 2}), rlqs=rlqs)
    assert cut.term(RLQS).tokens == 0  # deny-all: an Envoy cut off spends only what it holds


def test_rlqs_term_counts_carry_when_a_window_is_too_short_to_clamp() -> None:
    from kernel.bound import RLQS, RlqsShape, rlqs_clamped

    assert not rlqs_clamped(1_000) and rlqs_clamped(1_250) and rlqs_clamped(60_000)
    global_read = PoolShape.plain("global-read", 40_000, 1_000, 4_000, chunk_max=2_000, global_scope=True)
    rlqs = RlqsShape(envoys={"eu": 2, "us": 1}, buckets=40, max_assignment=100)
    b = pool_bound(global_read, TWO, rlqs=rlqs)
    assert b.term(RLQS).tokens == 3 * 40 * 100 and b.total == 40_000 + 12_000
    # a region that may not lease the pool holds no assignment of it
    only_eu = PoolShape(**{**msgspec.structs.asdict(global_read), "regions": ("eu",)})
    assert pool_bound(only_eu, TWO, rlqs=rlqs).term(RLQS).tokens == 2 * 40 * 100


def test_rlqs_fallback_other_than_deny_all_is_unbounded() -> None:
    from kernel.bound import RLQS, RlqsShape, envoy_fallback_tokens

    assert envoy_fallback_tokens("DENY_ALL", "DENY_ALL") == 0 and envoy_fallback_tokens("DENY_ALL", None) == 0
    assert envoy_fallback_tokens("DENY_ALL", "token_bucket") is None
    assert envoy_fallback_tokens("ALLOW_ALL", None) is None
    rlqs = RlqsShape(envoys={"eu": 1}, buckets=5, max_assignment=100, fallback=None)
    assert pool_bound(P_TENANT, TWO, rlqs=rlqs).term(RLQS).tokens == 0  # nobody cut off
    b = pool_bound(P_TENANT, TWO, Faults(envoys_cut_off={"eu": 1}), rlqs=rlqs)
    assert b.term(RLQS).tokens is None and b.total is None


def test_rlqs_term_of_a_rule_without_windows_is_one_assignment_per_envoy_and_bucket() -> None:
    from kernel.bound import RlqsShape, rlqs_term

    t = rlqs_term(RlqsShape(envoys={"eu": 2}, buckets=1, max_assignment=20), 0)
    assert t.tokens == 40 and "any span" in t.formula
