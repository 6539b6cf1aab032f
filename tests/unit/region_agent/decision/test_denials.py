"""region_agent.decision.denials: the negative cache as a decision uses it."""

from __future__ import annotations

from pathlib import Path

from kernel.bundle import load_bundle_file
from region_agent.decision.denials import Denials
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.negcache import NegativeCache
from region_agent.decision.outcome import Answer
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.models import AdmitRequest, DeniedScope, Principal, Reason
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
KB = KeyBuilder(b"unit-pepper")


def plan_of(route="read", cost=1):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group=route, cost_hint=cost,
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(Snapshot(NORTHSTAR), req, KB)


def denials() -> tuple[Denials, AgentMetrics, FakeClock]:
    m, c = AgentMetrics(), FakeClock(1_000_000.0)
    return Denials(NegativeCache(), m, c), m, c


def denial(plan, retry=1_500) -> Answer:
    return Answer(False, plan.slots[1].rule, DeniedScope.TENANT, Reason.RATE_EXCEEDED, 1_000, 0, retry)


def test_a_remembered_denial_answers_the_same_request_with_the_hint_left():
    d, m, clock = denials()
    plan = plan_of()
    assert d.hit(plan) is None
    d.remember(plan, 1, denial(plan))
    clock.t += 400
    held = d.hit(plan_of())
    assert held is not None and held == denial(plan, retry=1_100)  # the hint counted from now
    assert m.registry.get_sample_value("leasehold_agent_negative_cache_hits_total") == 1


def test_another_cost_asks_the_store():
    d, _, _ = denials()
    plan = plan_of()
    d.remember(plan, 1, denial(plan))
    assert d.hit(plan_of(cost=2)) is None  # the key includes the script arguments


def test_a_request_with_a_decision_record_never_meets_a_held_denial():
    d, _, _ = denials()
    plan = plan_of()
    d.remember(plan, 1, denial(plan))
    export = plan_of(route="export")
    assert export.decision_ttl_ms > 0
    d.remember(export, 2, denial(export))
    assert d.hit(export) is None


def test_forget_ends_the_held_denials_of_the_request():
    d, _, _ = denials()
    plan = plan_of()
    d.remember(plan, 1, denial(plan))
    d.forget(plan)
    assert d.hit(plan) is None and len(d.cache) == 0


def test_a_fallback_denial_is_held_for_the_request_at_most_the_cap_and_forgotten_by_it():
    """A denial of a call whose pool slot was replaced by its fallback allowance answers the
    request's own question again, for the cache's cap only (the allowance's hint is not exact)."""
    d, _, clock = denials()
    plan = plan_of()
    other = [plan.calls[0], plan.calls[1]._replace(key=plan.calls[1].key + ":fb")]
    d.remember(plan, 1, denial(plan, retry=5_000), calls=other, fallback=True)
    assert d.hit(plan) is not None and len(d.cache) == 2  # the request's rule set, the replacement's key
    clock.t += 300  # past the 250 ms cap: this caller probes the store
    assert d.hit(plan) is None
    d.forget(plan, other)
    assert len(d.cache) == 0


def test_a_held_denial_answers_another_rule_set_only_briefly():
    """Read (user + tenant rule) denied by the tenant slot with a 30 s hint: the same rule set is
    held for the whole hint; a search of the same tenant (the tenant rule alone) shares the
    tenant key but not the rule set: denied locally for the cache's cap at most, with a hint no
    longer than that, then it asks the store."""
    d, _, clock = denials()
    read = plan_of()
    d.remember(read, 1, denial(read, retry=30_000))
    other_route = plan_of(route="search")
    assert read.calls[1].key in {c.key for c in other_route.calls}
    brief = d.hit(other_route)
    assert brief is not None and brief.retry <= 250
    assert d.hit(plan_of()).retry == 30_000
    clock.t += 300
    assert d.hit(other_route) is None  # past the cap: it asks the store
    assert d.hit(plan_of()).retry == 29_700


def test_a_remembered_question_meets_the_same_held_denials_by_its_lookup_keys():
    """A plan whose question is remembered (region_agent.decision.plan: Plan.denial_keys built
    once) finds exactly what a plan built afresh finds: the whole rule set's denial, and a
    slot's short hold shared with another rule set."""
    snap = Snapshot(NORTHSTAR)
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group="read",
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    build_plan(snap, req, KB)
    remembered = build_plan(snap, req, KB)  # asked twice: remembered with its lookup keys
    assert remembered.denial_keys and not plan_of().denial_keys
    d, _, clock = denials()
    assert d.hit(remembered) is None
    d.remember(plan_of(), 1, denial(plan_of()))
    clock.t += 100
    assert d.hit(remembered) == d.hit(plan_of()) == denial(remembered, retry=1_400)
    other = plan_of(route="export")  # shares the tenant's key, not the rule set: the short hold only
    d2, _, clock2 = denials()
    d2.remember(other, [s.rule.id for s in other.slots].index("tenant-atlas-minute"), denial(other, retry=30_000))
    clock2.t += 10
    assert d2.hit(remembered) == d2.hit(plan_of()) is not None
