"""region_agent.record: an answer as the decision record with its HTTP answer."""

from __future__ import annotations

from pathlib import Path

from kernel.bundle import load_bundle_file
from region_agent.keys import KeyBuilder
from region_agent.metrics import AgentMetrics
from region_agent.models import AdmitRequest, DeniedScope, Principal, Reason
from region_agent.outcome import Answer
from region_agent.plan import build_plan
from region_agent.record import SHED, SHED_RETRY_MS, conflict_record, decision_record

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))
KB = KeyBuilder(b"unit-pepper")


def plan_of(principal=None):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group="read",
                       principal=principal or Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(NORTHSTAR, req, KB)


def test_an_admission_carries_no_denial_fields_and_its_own_ratelimit_fields():
    plan = plan_of()
    rule = plan.rules[0]
    d = decision_record(plan, NORTHSTAR, Answer(True, rule, DeniedScope.USER, Reason.RATE_EXCEEDED, 20, 17, 900),
                        AgentMetrics())
    assert (d.allowed, d.decision_id, d.policy_id, d.policy_version) == (True, plan.request_id, rule.id, 42)
    assert (d.denied_scope, d.reason, d.retry_after_ms) == (None, None, 0)  # never a denial's fields
    assert (d.limit, d.remaining, d.http_status) == (20, 17, 200) and "RateLimit" in d.headers


def test_a_denial_is_a_429_with_its_scope_reason_and_retry_after():
    plan = plan_of()
    rule = plan.slots[1].rule
    d = decision_record(plan, NORTHSTAR, Answer(False, rule, DeniedScope.TENANT, Reason.RATE_EXCEEDED, 1_000, 0,
                                                1_500, True), AgentMetrics())
    assert (d.denied_scope, d.reason, d.retry_after_ms, d.fallback) == ("tenant", "RATE_EXCEEDED", 1_500, True)
    assert d.http_status == 429 and d.headers["Retry-After"] == "2"


def test_a_denial_without_a_positive_hint_is_counted_as_a_policy_defect():
    m = AgentMetrics()
    plan = plan_of()
    rule = plan.rules[0]
    decision_record(plan, NORTHSTAR, Answer(False, rule, DeniedScope.USER, Reason.RATE_EXCEEDED, 20, 0, -1), m)
    assert m.registry.get_sample_value("leasehold_agent_policy_defects_total", {"rule": rule.id}) == 1


def test_shed_is_a_retriable_503_without_a_rule():
    d = decision_record(plan_of(), NORTHSTAR, SHED, AgentMetrics())
    assert (d.http_status, d.reason, d.policy_id, d.retry_after_ms) == (503, Reason.OVERLOADED, None, SHED_RETRY_MS)


def test_a_conflict_is_a_409_problem_naming_the_decision():
    plan = plan_of()
    d = conflict_record(plan, NORTHSTAR)
    assert (d.allowed, d.http_status, d.reason, d.retry_after_ms) == (False, 409, Reason.REQUEST_ID_CONFLICT, -1)
    assert d.problem is not None and d.problem["status"] == 409 and d.problem["decisionId"] == plan.request_id
