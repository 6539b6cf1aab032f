"""region_agent.decision.counting: pool tokens an admission spent, and shadow rules' verdicts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import load_bundle_file
from kernel.errors import StoreUnavailable
from region_agent.decision.counting import count_pool_admissions, count_shadow, tenant_pool_slots
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.models import AdmitRequest, Principal
from region_agent.service.metrics import AgentMetrics

POLICIES = Path(__file__).resolve().parents[4] / "policies"
NORTHSTAR = load_bundle_file(str(POLICIES / "northstar.json"))
GLOBAL = load_bundle_file(str(POLICIES / "northstar-global.json"))
KB = KeyBuilder(b"unit-pepper")


def plan_of(bundle, cost=1):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group="read", cost_hint=cost,
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(Snapshot(bundle), req, KB)


def admitted(m: AgentMetrics, pool: str, source: str) -> float:
    return m.registry.get_sample_value("leasehold_agent_pool_admitted_tokens_total",
                                       {"pool": pool, "source": source}) or 0.0


def test_tenant_pool_slots_name_the_pool_its_balance_and_tokens():
    plan = plan_of(GLOBAL, cost=3)
    ((idx, pool, key, tokens),) = tenant_pool_slots(plan, Snapshot(GLOBAL).pools)
    assert (idx, pool.id, key, tokens) == (1, "atlas-minute", plan.calls[1].key, 3)
    assert tenant_pool_slots(plan_of(NORTHSTAR), Snapshot(NORTHSTAR).pools) == []


def test_an_admission_counts_its_tenant_and_fleet_pool_tokens_by_source():
    m = AgentMetrics()
    plan = plan_of(GLOBAL, cost=2)
    count_pool_admissions(m, plan, Snapshot(GLOBAL).pools, plan.global_spends, fallback=False)
    assert admitted(m, "atlas-minute", "lease") == 2
    assert admitted(m, "global-read", "lease") == plan.global_spends[0].cost
    count_pool_admissions(m, plan, Snapshot(GLOBAL).pools, [], fallback=True)
    assert admitted(m, "atlas-minute", "fallback") == 2 and admitted(m, "global-read", "fallback") == 0


def shadow_plan():
    bundle = msgspec.structs.replace(NORTHSTAR, rules=[msgspec.structs.replace(r, shadow=True)
                                                       if r.id == "tenant-atlas-minute" else r
                                                       for r in NORTHSTAR.rules])
    plan = plan_of(bundle)
    assert [s.rule.id for s in plan.shadow_slots] == ["tenant-atlas-minute"]
    return plan


def shadow(m: AgentMetrics, verdict: str) -> float:
    return m.registry.get_sample_value("leasehold_agent_shadow_decisions_total",
                                       {"rule": "tenant-atlas-minute", "outcome": verdict}) or 0.0


def test_shadow_verdicts_are_counted_by_rule():
    m = AgentMetrics()
    plan = shadow_plan()
    count_shadow(m, plan, [1, 0, 0, 999_000])
    count_shadow(m, plan, [0, 1, 500, 0])
    count_shadow(m, plan, StoreUnavailable("down"))
    count_shadow(m, plan, "garbage")
    assert (shadow(m, "allowed"), shadow(m, "denied"), shadow(m, "error")) == (1, 1, 2)
