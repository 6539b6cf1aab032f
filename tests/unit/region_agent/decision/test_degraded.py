"""region_agent.decision.degraded: the answers given without the store's verdict - per failMode when the
store failed, and a tenant pool's fallback allowance with the allocator unreachable."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.algorithms.pool_window import MAX_SPAN
from kernel.bundle import load_bundle_file
from kernel.errors import AmbiguousOutcome, Overloaded, ScriptRejected, StoreUnavailable
from region_agent.decision.degraded import LocalAnswers, degrade_label
from region_agent.decision.fallback import LocalAllowances
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.leasing.window_clock import Windows
from region_agent.models import AdmitRequest, DeniedScope, Principal, Reason
from region_agent.service.metrics import AgentMetrics

POLICIES = Path(__file__).resolve().parents[4] / "policies"
NORTHSTAR = load_bundle_file(str(POLICIES / "northstar.json"))
GLOBAL = load_bundle_file(str(POLICIES / "northstar-global.json"))
KB = KeyBuilder(b"unit-pepper")
ONE_WINDOW = Windows(lo=7, hi=7, end_in_ms=20_000, safe_ms=19_000)


def plan_of(bundle, route="read", cost=1):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group=route, cost_hint=cost,
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(Snapshot(bundle), req, KB)


def answers(windows: Windows = ONE_WINDOW) -> tuple[LocalAnswers, AgentMetrics]:
    m = AgentMetrics()
    return LocalAnswers(allowances=LocalAllowances(), windows=lambda pool: windows, metrics=m,
                        now_ms=lambda: 5_000_000.0), m


def sample(m: AgentMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------- the store failed
def test_overload_is_shed_never_answered_locally():
    la, m = answers()
    full = Overloaded("queue full", extra={"reason": "QUEUE_FULL"})
    assert la.store_failed(plan_of(NORTHSTAR), Snapshot(NORTHSTAR).pools, full).shed == "queue_full"
    assert sample(m, "leasehold_agent_queue_rejections_total") == 1
    got = la.store_failed(plan_of(NORTHSTAR), Snapshot(NORTHSTAR).pools, Overloaded("late"))
    assert (got.shed, got.answer) == ("queue", None)
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="STORE_UNREACHABLE",
                  fail_mode="local_bounded") == 0


def test_a_closed_rule_answers_503_limiter_unavailable():
    la, m = answers()
    plan = plan_of(NORTHSTAR, route="export")
    got = la.store_failed(plan, Snapshot(NORTHSTAR).pools, StoreUnavailable("down"))
    a = got.answer
    assert a is not None and not a.allowed and a.rule.id == "export-tenant"
    assert (a.scope, a.reason, a.retry) == (DeniedScope.TENANT, Reason.LIMITER_UNAVAILABLE, 5_000)
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="STORE_UNREACHABLE", fail_mode="closed") == 1
    assert sample(m, "leasehold_agent_script_errors_total", error="StoreUnavailable") == 1


def test_open_rules_admit_without_a_check():
    opened = msgspec.structs.replace(NORTHSTAR, rules=[msgspec.structs.replace(r, fail_mode="open")
                                                       for r in NORTHSTAR.rules])
    la, m = answers()
    got = la.store_failed(plan_of(opened), Snapshot(opened).pools, AmbiguousOutcome("?"))
    assert (got.answer, got.shed) == (None, None)
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="AMBIGUOUS", fail_mode="open") == 1


def test_local_bounded_rules_answer_from_their_fallback_buckets_all_or_nothing():
    la, _ = answers()
    plan = plan_of(NORTHSTAR)  # read-user-v3 and tenant-atlas-minute, both local_bounded
    pools = Snapshot(NORTHSTAR).pools
    first = la.store_failed(plan, pools, StoreUnavailable("down")).answer
    assert first is not None and first.allowed and first.fallback and first.rule.id == "read-user-v3"
    user_limit = plan.rules[0].fallback.limit_tokens
    assert first.limit == user_limit and first.remaining == user_limit - 1
    for _ in range(user_limit - 1):
        assert la.store_failed(plan, pools, StoreUnavailable("down")).answer.allowed
    denied = la.store_failed(plan, pools, StoreUnavailable("down")).answer
    assert (denied.allowed, denied.rule.id, denied.scope, denied.fallback) == (False, "read-user-v3",
                                                                                DeniedScope.USER, True)
    assert denied.retry > 0


def test_a_tenant_pool_spends_its_per_window_allowance_when_redis_is_lost():
    la, _ = answers()
    plan = plan_of(GLOBAL)  # read-user-v3 + the atlas pool (fallbackPerRegion 100)
    a = la.local_admit(plan, [plan.slots[1].rule, plan.slots[0].rule], Snapshot(GLOBAL).pools)
    assert a.allowed and a.fallback and a.limit == plan.rules[0].fallback.limit_tokens
    assert la.allowances.used("atlas-minute", 7) == 1  # counted in allocator window 7


def test_an_uncertain_allocator_clock_denies_a_pools_local_allowance():
    wide = Windows(lo=7, hi=7 + MAX_SPAN, end_in_ms=30_000, safe_ms=0)
    la, _ = answers(wide)
    plan = plan_of(GLOBAL)
    a = la.local_admit(plan, [plan.slots[1].rule], Snapshot(GLOBAL).pools)
    assert (a.allowed, a.reason, a.limit, a.remaining, a.retry, a.fallback) == (
        False, Reason.RATE_EXCEEDED, 100, 0, 30_000, True)


def test_a_script_rejection_closes_a_pool_rule_and_is_labelled_policy_error():
    la, m = answers()
    got = la.store_failed(plan_of(GLOBAL), Snapshot(GLOBAL).pools, ScriptRejected("bad"))
    assert got.answer is not None and got.answer.reason is Reason.POLICY_ERROR
    assert degrade_label(ScriptRejected("bad")) == "POLICY_ERROR"
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="POLICY_ERROR", fail_mode="closed") == 1


# ------------------------------------------------------------------------------- pool fallback allowance
def test_the_pool_allowance_call_replaces_the_balance_slot_only():
    la, m = answers()
    plan = plan_of(GLOBAL)
    fb = la.pool_allowance(plan, Snapshot(GLOBAL).pools, 1)
    assert fb.closed is None and fb.call is not None and fb.retry_floor_ms == 20_000
    assert fb.calls[0] == plan.calls[0]
    assert fb.calls[1].key == KeyBuilder.pool_fallback_key(plan.calls[1].key)
    assert fb.calls[1].params == (100, 7, 7, plan.calls[1].params[0], 20_000 + 60_000)
    script, keys, _ = fb.call
    assert script == "multi_rule[pw,tb]" and keys[0] == plan.decision_key + ":fb"  # never the request's own record
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="ALLOCATOR_UNREACHABLE",
                  fail_mode="pool_fallback") == 1


def test_no_allowance_or_a_closed_rule_answers_503():
    for bundle in (
        msgspec.structs.replace(GLOBAL, pools=[msgspec.structs.replace(p, fallback_per_region=0)
                                               for p in GLOBAL.pools]),
        msgspec.structs.replace(GLOBAL, rules=[msgspec.structs.replace(r, fail_mode="closed")
                                               if r.id == "tenant-atlas-global" else r for r in GLOBAL.rules]),
    ):
        la, m = answers()
        fb = la.pool_allowance(plan_of(bundle), Snapshot(bundle).pools, 1)
        assert fb.call is None and fb.closed is not None
        assert (fb.closed.allowed, fb.closed.reason, fb.closed.scope) == (False, Reason.LIMITER_UNAVAILABLE,
                                                                          DeniedScope.TENANT)
        assert sample(m, "leasehold_agent_degraded_decisions_total", reason="ALLOCATOR_UNREACHABLE",
                      fail_mode="closed") == 1


def test_an_uncertain_clock_leaves_the_scripts_denial_standing():
    la, _ = answers(Windows(lo=1, hi=1 + MAX_SPAN, end_in_ms=45_000, safe_ms=0))
    fb = la.pool_allowance(plan_of(GLOBAL), Snapshot(GLOBAL).pools, 1)
    assert (fb.closed, fb.call, fb.retry_floor_ms) == (None, None, 45_000)
