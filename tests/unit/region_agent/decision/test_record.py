
"""region_agent.decision.record: an answer as the decision record with its HTTP answer."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.bundle import load_bundle_file
from region_agent.decision.call import MultiRuleResult
from region_agent.decision.httpmap import RetryJitter
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.outcome import Answer, NextStep, outcome
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.decision.record import (
    SHED,
    SHED_RETRY_MS,
    admitted_reply,
    conflict_record,
    decision_record,
    early_record,
)
from region_agent.models import AdmitRequest, DecisionSource, DeniedScope, Principal, Reason
from region_agent.service.metrics import AgentMetrics

# These tests check the worked numbers' exact Retry-After (max(1, ceil(ms / 1000))): jitter off here
# (its spread has its own tests: test_retry_jitter.py)
NO_JITTER = RetryJitter(0, 0, min_ms=0)

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
KB = KeyBuilder(b"unit-pepper")


def plan_of(principal=None):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group="read",
                       principal=principal or Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(Snapshot(NORTHSTAR, NO_JITTER), req, KB)


def test_an_admission_carries_no_denial_fields_and_its_own_ratelimit_fields():
    plan = plan_of()
    rule = plan.rules[0]
    d = decision_record(plan, Snapshot(NORTHSTAR, NO_JITTER), Answer(True, rule, DeniedScope.USER, Reason.RATE_EXCEEDED, 20, 17, 900),
                        AgentMetrics())
    assert (d.allowed, d.decision_id, d.rule_id, d.bundle_version) == (True, plan.request_id, rule.id, 42)
    assert (d.denied_scope, d.reason, d.retry_after_ms) == (None, None, 0)  # never a denial's fields
    assert (d.limit, d.remaining, d.http_status) == (20, 17, 200) and "RateLimit" in d.headers


def test_a_denial_is_a_429_with_its_scope_reason_and_retry_after():
    plan = plan_of()
    rule = plan.slots[1].rule
    d = decision_record(plan, Snapshot(NORTHSTAR, NO_JITTER), Answer(False, rule, DeniedScope.TENANT, Reason.RATE_EXCEEDED, 1_000, 0,
                                                1_500, True), AgentMetrics())
    assert (d.denied_scope, d.reason, d.retry_after_ms, d.fallback) == ("tenant", "RATE_EXCEEDED", 1_500, True)
    assert d.http_status == 429 and d.headers["Retry-After"] == "2"


def test_a_denial_without_a_positive_hint_is_counted_as_a_policy_defect():
    m = AgentMetrics()
    plan = plan_of()
    rule = plan.rules[0]
    decision_record(plan, Snapshot(NORTHSTAR, NO_JITTER), Answer(False, rule, DeniedScope.USER, Reason.RATE_EXCEEDED, 20, 0, -1), m)
    assert m.registry.get_sample_value("leasehold_agent_policy_defects_total", {"rule": rule.id}) == 1


def test_shed_is_a_retriable_503_without_a_rule():
    d = decision_record(plan_of(), Snapshot(NORTHSTAR, NO_JITTER), SHED, AgentMetrics())
    assert (d.http_status, d.reason, d.rule_id, d.retry_after_ms) == (503, Reason.OVERLOADED, None, SHED_RETRY_MS)


def test_a_conflict_is_a_409_problem_naming_the_decision():
    plan = plan_of()
    d = conflict_record(plan, NORTHSTAR)
    assert (d.allowed, d.http_status, d.reason, d.retry_after_ms) == (False, 409, Reason.REQUEST_ID_CONFLICT, -1)
    assert d.problem is not None and d.problem["status"] == 409 and d.problem["decisionId"] == plan.request_id


def test_an_early_gates_record_is_the_same_record_as_the_engines_and_is_counted():
    """The admission's early gates (stale policy, pre-authentication cap) build their records here
    too: the same record decision_record gives the same answer, counted under the rule that answered."""
    plan = plan_of()
    rule = plan.rules[0]
    req = AdmitRequest(request_id=plan.request_id, tenant_id="atlas", route_group="read",
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    stale = Answer(False, rule, DeniedScope.USER, Reason.POLICY_STALE, retry=rule.closed_retry_after_ms)
    m = AgentMetrics()
    early = early_record(req, Snapshot(NORTHSTAR, NO_JITTER), stale, DecisionSource.POLICY, m, counted=rule, tenant="atlas")
    assert early == decision_record(plan, Snapshot(NORTHSTAR, NO_JITTER), stale, AgentMetrics(), DecisionSource.POLICY)
    assert (early.http_status, early.reason, early.source) == (503, Reason.POLICY_STALE, DecisionSource.POLICY)
    assert early.problem is not None and "older than its maximum age" in early.problem["detail"]
    assert m.registry.get_sample_value("leasehold_agent_decisions_total", {
        "outcome": "unavailable", "rule": rule.id, "policy_version": "42", "route_group": rule.route_key,
        "tenant": "atlas", "source": "policy"}) == 1


# --- an admission's record from the parts built once per plan shape (the engine's common path) ---
GLOBAL = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))
METRICS = AgentMetrics()
PRINCIPALS = [Principal(type="user", id="U-17", api_key_id="K1"), Principal(type="user", id="U-18"),
              Principal(type="service", id="svc-9"), Principal(type="service", id="svc-9", api_key_id="K2"),
              Principal(type="anonymous", id="203.0.113.7")]


def general_record(plan, bundle, res):
    """What the engine's general path makes of a store admission: outcome, then decision_record."""
    o = outcome(plan, Snapshot(bundle, NO_JITTER).pools, res)
    if o.step is NextStep.ALLOWED_WITHOUT_SCRIPT:
        return None
    assert o.step is NextStep.ANSWER and o.answer is not None
    return decision_record(plan, Snapshot(bundle, NO_JITTER), o.answer, METRICS)


@settings(max_examples=400, deadline=None)
@given(bundle=st.sampled_from([NORTHSTAR, GLOBAL]), tenant=st.sampled_from(["atlas", "birch", "northstar-ops", "zeta"]),
       route=st.sampled_from(["read", "export", "login", "probe", "write"]), principal=st.sampled_from(PRINCIPALS),
       cost=st.integers(1, 1_000), raws=st.lists(st.integers(-5, 10**9), min_size=1, max_size=10),
       rid=st.integers(0, 10**6))
def test_an_admission_built_from_its_shape_parts_is_the_general_paths_record(bundle, tenant, route, principal, cost,
                                                                             raws, rid):
    req = AdmitRequest(request_id=f"r-{rid:016x}", tenant_id=tenant, route_group=route, principal=principal,
                       cost_hint=cost)
    plan = build_plan(Snapshot(bundle, NO_JITTER), req, KB)
    res = MultiRuleResult(True, 0, 0, tuple(raws))  # fewer counts than slots: a missing one reports 0, as the general path
    want = general_record(plan, bundle, res)
    reply = [1, 0, 0, *raws]
    assert admitted_reply(plan, Snapshot(bundle, NO_JITTER), reply) == want
    assert admitted_reply(plan, Snapshot(bundle, NO_JITTER), reply) == want  # the second time from the memoised parts


@settings(max_examples=400, deadline=None)
@given(bundle=st.sampled_from([NORTHSTAR, GLOBAL]), tenant=st.sampled_from(["atlas", "birch", "zeta"]),
       route=st.sampled_from(["read", "export", "login"]), principal=st.sampled_from(PRINCIPALS),
       reply=st.one_of(st.lists(st.one_of(st.integers(-2, 10**9), st.booleans(), st.just(b"1"), st.just("x"),
                                          st.just(1.0)), max_size=7),
                       st.lists(st.integers(-1, 10**9), min_size=4, max_size=7), st.just(None), st.just((1, 0, 0, 5))))
def test_an_admission_read_straight_from_its_reply_is_the_parsed_replys_record(bundle, tenant, route, principal, reply):
    """The engine's common case reads a store admission's record straight from the script's reply
    (admitted_reply): the general path's record of parse_multi_rule's result, or None —
    never for a reply the parse reads as an admission of plain ints, always for one it refuses,
    a denial or a conflict."""
    from region_agent.decision.call import parse_multi_rule

    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id=tenant, route_group=route, principal=principal)
    snap = Snapshot(bundle, NO_JITTER)
    plan = build_plan(snap, req, KB)
    try:
        res = parse_multi_rule(reply)
    except Exception:
        res = None
    got = admitted_reply(plan, snap, reply)
    want = general_record(plan, bundle, res) if res is not None and res.allowed else None
    plain = reply.__class__ is list and all(x.__class__ is int for x in reply)
    assert got == want if plain else got is None


def test_a_users_admission_from_shape_parts_carries_its_ratelimit_fields():
    plan = plan_of()
    d = admitted_reply(plan, Snapshot(NORTHSTAR, NO_JITTER), [1, 0, 0, 17_500, 900_000])
    assert d == general_record(plan, NORTHSTAR, MultiRuleResult(True, 0, 0, (17_500, 900_000)))
    assert (d.limit, d.remaining, d.http_status) == (20, 17, 200)
    assert d.headers == {"RateLimit-Policy": '"read-user-v3";q=20;w=10', "RateLimit": '"read-user-v3";r=17;t=0'}


def test_no_shape_part_answers_when_no_slot_reports_or_the_plan_has_no_shape():
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="zeta", route_group="read",
                       principal=Principal(type="service", id="svc-9"))
    plan = build_plan(Snapshot(GLOBAL, NO_JITTER), req, KB)  # only global-catalog, a fleet-wide pool spent from chunks: no slot reports
    assert plan.rules[0].fleet_wide and admitted_reply(plan, Snapshot(GLOBAL, NO_JITTER), [1, 0, 0, 5]) is None
    shapeless = plan_of()
    shapeless.shape = None
    assert admitted_reply(shapeless, Snapshot(NORTHSTAR, NO_JITTER), [1, 0, 0, 17_500, 0]) is None
