"""What a decision's script answer means (region_agent/decision/outcome.py): pure, table-driven over the
sample policies' plans (northstar: token buckets, a concurrency gate with a decision record;
northstar-global: tenant pools spent from leased balances)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel.bundle import load_bundle_file
from kernel.errors import (
    AmbiguousOutcome,
    DecisionConflict,
    NothingRan,
    Overloaded,
    ScriptRejected,
    StoreUnavailable,
)
from region_agent.decision.call import MultiRuleResult
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.outcome import Answer, Mode, NextStep, degrade, outcome, pool_denial_slot
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.leasing.book import BalanceState
from region_agent.models import AdmitRequest, Principal, Reason

POLICIES = Path(__file__).resolve().parents[4] / "policies"
NORTHSTAR = load_bundle_file(str(POLICIES / "northstar.json"))
GLOBAL = load_bundle_file(str(POLICIES / "northstar-global.json"))
KB = KeyBuilder(b"unit-pepper")


def plan_of(bundle, route="read", tenant="atlas", cost=1, rid="r-9f3a61c2e07b4d18"):
    req = AdmitRequest(request_id=rid, tenant_id=tenant, principal=Principal(type="user", id="U-17", api_key_id="K1"),
                       route_group=route, cost_hint=cost)
    return build_plan(Snapshot(bundle), req, KB)


def pools(bundle):
    return Snapshot(bundle).pools


def test_allowed_reports_the_first_rule_in_whole_tokens():
    plan = plan_of(NORTHSTAR)  # read-user-v3 (capacity 20 tokens), tenant-atlas-minute
    o = outcome(plan, pools(NORTHSTAR), MultiRuleResult(True, 0, 0, (17_500, 900_000)))
    assert o.step is NextStep.ANSWER
    assert o.answer == Answer(True, plan.rules[0], limit=20, remaining=17)


def test_rate_denial_names_its_rule_scope_and_hint_and_may_be_cached():
    plan = plan_of(NORTHSTAR)
    o = outcome(plan, pools(NORTHSTAR), MultiRuleResult(False, 2, 1_500, (20_000, 400)))
    tenant_rule = plan.slots[1].rule
    assert o.answer == Answer(False, tenant_rule, "tenant", Reason.RATE_EXCEEDED, 1_000, 0, 1_500)
    assert o.cacheable and o.slot == 1  # no decision record: the negative cache may answer the next one


def test_a_retry_floor_raises_a_short_hint_but_never_a_never():
    plan = plan_of(NORTHSTAR)
    short = outcome(plan, pools(NORTHSTAR), MultiRuleResult(False, 1, 10, (0, 0)), retry_floor_ms=250)
    never = outcome(plan, pools(NORTHSTAR), MultiRuleResult(False, 1, -1, (0, 0)), retry_floor_ms=250)
    assert short.answer is not None and short.answer.retry == 250
    assert never.answer is not None and never.answer.retry == -1


def test_concurrency_gate_denial_and_a_decision_record_is_not_cached():
    plan = plan_of(NORTHSTAR, route="export", cost=2)  # slots: cc gate, export rate, tenant rate
    o = outcome(plan, pools(NORTHSTAR), MultiRuleResult(False, 1, 0, (3, 0, 0)))
    rule = plan.slots[0].rule
    assert o.answer == Answer(False, rule, "concurrency", Reason.CONCURRENCY_EXCEEDED, 3, 0,
                              rule.concurrency_retry_after_ms)
    assert not o.cacheable
    rate = outcome(plan, pools(NORTHSTAR), MultiRuleResult(False, 2, 700, (1, 0, 0)))
    assert rate.answer is not None and rate.answer.reason is Reason.RATE_EXCEEDED
    assert not rate.cacheable  # the export rule keeps a decision record


@pytest.mark.parametrize(("error", "can_retry", "step"), [
    (DecisionConflict("other question"), True, NextStep.CONFLICT),
    (AmbiguousOutcome("lost reply"), True, NextStep.RETRY_SAME),  # a decision record replays it
    (AmbiguousOutcome("lost reply"), False, NextStep.DEGRADE),  # no budget left
    (NothingRan("reload lost"), True, NextStep.RESEND),  # it did not run: sent again
    (NothingRan("reload lost"), False, NextStep.DEGRADE),  # no budget left, or sent again already
    (StoreUnavailable("down"), True, NextStep.DEGRADE),
    (ScriptRejected("bad"), True, NextStep.DEGRADE),
])
def test_errors_of_an_idempotent_decision(error, can_retry, step):
    plan = plan_of(NORTHSTAR, route="export")
    o = outcome(plan, pools(NORTHSTAR), error, can_retry=can_retry)
    assert o.step is step and o.error is error and o.answer is None


def test_an_ambiguous_cheap_read_is_never_retried_blindly():
    plan = plan_of(NORTHSTAR)  # no decision record: a second send could debit twice (I6)
    assert outcome(plan, pools(NORTHSTAR), AmbiguousOutcome("lost"), can_retry=True).step is NextStep.DEGRADE


def test_a_cheap_read_that_did_not_run_is_sent_again():
    """No decision record, but nothing ran: a second send debits once at most (unlike I6's case)."""
    plan = plan_of(NORTHSTAR)
    o = outcome(plan, pools(NORTHSTAR), NothingRan("reload lost"), can_retry=True)
    assert o.step is NextStep.RESEND and isinstance(o.error, NothingRan)
    assert outcome(plan, pools(NORTHSTAR), NothingRan("reload lost")).step is NextStep.DEGRADE


def test_pool_denial_by_balance_state():
    plan = plan_of(GLOBAL, route="write")  # tenant-atlas-global spends pool atlas-minute
    idx = next(i for i, s in enumerate(plan.slots) if s.rule.id == "tenant-atlas-global")
    res = MultiRuleResult(False, idx + 1, 0, tuple(0 for _ in plan.slots))
    p = pools(GLOBAL)
    assert outcome(plan, p, res, BalanceState.UNREACHABLE, can_retry=True).step is NextStep.POOL_FALLBACK
    wait = outcome(plan, p, res, BalanceState.OK, can_retry=True)
    assert wait.step is NextStep.WAIT_TOP_UP and wait.slot == idx
    # after one wait, or with nothing in flight: a plain 429 with the lease book's hint
    for o in (outcome(plan, p, res, BalanceState.OK, can_retry=True, waited=True, retry_floor_ms=800),
              outcome(plan, p, res, BalanceState.EXHAUSTED, retry_floor_ms=800)):
        assert o.step is NextStep.ANSWER
        assert o.answer == Answer(False, plan.slots[idx].rule, "tenant", Reason.RATE_EXCEEDED, 1_000, 0, 800)
    # remembered only when the allocator said the window is spent: an empty balance whose top-up
    # may land before the hint is asked again (the negative cache denied what the top-up paid)
    assert [o.cacheable for o in (outcome(plan, p, res, BalanceState.OK, can_retry=True, waited=True),
                                  outcome(plan, p, res, BalanceState.IDLE),
                                  outcome(plan, p, res, BalanceState.EXHAUSTED),
                                  outcome(plan, p, res, None),
                                  outcome(plan, p, res, BalanceState.UNREACHABLE, fallback=True))] \
        == [False, False, True, True, True]
    # exhausted is never the fallback; without a lease manager the script's denial stands
    assert outcome(plan, p, res, BalanceState.EXHAUSTED, can_retry=True).step is NextStep.WAIT_TOP_UP
    assert outcome(plan, p, res, None, can_retry=True).step is NextStep.ANSWER
    # the fallback allowance's own denial is an answer, flagged
    fb = outcome(plan, p, res, BalanceState.UNREACHABLE, fallback=True)
    assert fb.step is NextStep.ANSWER and fb.answer is not None and fb.answer.fallback


def test_allowed_without_a_reporting_slot():
    """The first rule is a fleet-wide pool (spent from a chunk, not in the script): the engine
    reports it from the chunk, not from the script's slots."""
    plan = plan_of(GLOBAL, route="read", tenant="nobody")  # read-user-v3 in the script, global-catalog not
    catalog = next(r for r in plan.rules if r.id == "global-catalog")
    assert catalog.fleet_wide and [s.rule.id for s in plan.slots] == ["read-user-v3"]
    plan.rules = [catalog, plan.rules[0]]
    o = outcome(plan, pools(GLOBAL), MultiRuleResult(True, 0, 0, (15_000,)))
    assert o.step is NextStep.ALLOWED_WITHOUT_SCRIPT and o.answer is None


# --- failMode --------------------------------------------------------------------------------------
def rules_of(plan):
    return [s.rule for s in plan.slots]


def test_overload_is_shed_never_degraded():
    plan = plan_of(NORTHSTAR)
    assert degrade(rules_of(plan), pools(NORTHSTAR), Overloaded("busy")).mode is Mode.SHED


def test_a_closed_rule_closes_the_decision():
    plan = plan_of(NORTHSTAR, route="export")
    how = degrade(rules_of(plan), pools(NORTHSTAR), StoreUnavailable("down"))
    assert how.mode is Mode.CLOSED and how.rule is not None and how.rule.id == "export-tenant"
    assert how.reason is Reason.LIMITER_UNAVAILABLE
    rejected = degrade(rules_of(plan), pools(NORTHSTAR), ScriptRejected("bad"))
    assert rejected.reason is Reason.POLICY_ERROR


def test_local_bounded_rules_decide_locally_pool_allowances_first():
    plan = plan_of(GLOBAL, route="write")
    how = degrade(rules_of(plan), pools(GLOBAL), StoreUnavailable("down"))
    assert how.mode is Mode.LOCAL
    assert how.local[0].id == "tenant-atlas-global"
    assert len(set(how.local)) == len(how.local)


def test_a_script_rejection_never_admits_a_pools_tokens():
    plan = plan_of(GLOBAL, route="write")
    how = degrade(rules_of(plan), pools(GLOBAL), ScriptRejected("bad"))
    assert how.mode is Mode.CLOSED and how.rule is not None and how.rule.id == "tenant-atlas-global"
    assert how.reason is Reason.POLICY_ERROR


def test_open_rules_admit_without_a_check():
    plan = plan_of(NORTHSTAR)
    opened = [r.__class__(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "fail_mode": "open"})
              for r in rules_of(plan)]
    assert degrade(opened, pools(NORTHSTAR), StoreUnavailable("down")) == (Mode.OPEN, None, None, ())


def test_pool_denial_slot_names_only_a_denying_tenant_pool_slot():
    plan = plan_of(GLOBAL)  # read-user-v3, then the atlas pool
    assert pool_denial_slot(plan, MultiRuleResult(False, 2, 100, (5_000, 0))) == 1
    assert pool_denial_slot(plan, MultiRuleResult(False, 1, 100, (0, 50))) is None  # a bucket denied
    assert pool_denial_slot(plan, MultiRuleResult(True, 0, 0, (5_000, 50))) is None
    assert pool_denial_slot(plan, MultiRuleResult(False, 9, 100, ())) is None  # out of range
    assert pool_denial_slot(plan, StoreUnavailable("down")) is None
