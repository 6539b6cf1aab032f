"""Rule selection and effective cost -> the script calls of one decision (pure)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kernel.bundle import Bundle, Pool, Rule, load_bundle_file, seal
from kernel.errors import ValidationFailed
from region_agent.keys import KeyBuilder, hash_tag
from region_agent.models import AdmitRequest, Principal
from region_agent.plan import build_plan, cc_keys_for_release, tokens_limit, tokens_remaining

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))
KB = KeyBuilder(b"unit-pepper")


def req(rid="r-9f3a61c2e07b4d18", tenant="atlas", ptype="user", pid="U-17", route="read", cost=1, key="K1"):
    return AdmitRequest(request_id=rid, tenant_id=tenant, principal=Principal(type=ptype, id=pid, api_key_id=key),
                        route_group=route, cost_hint=cost)


def test_read_request_user_then_tenant_with_effective_cost():
    plan = build_plan(NORTHSTAR, req(cost=3), KB)
    assert [r.id for r in plan.rules] == ["read-user-v3", "tenant-atlas-minute"]
    assert [c.kind for c in plan.calls] == ["tb", "tb"]
    assert plan.calls[0].params == (20_000, 2_000, 1_000, 3_000, 0)
    assert plan.calls[1].params == (1_000_000, 1_000_000, 60_000, 3_000, 0)
    assert plan.decision_ttl_ms == 0 and plan.slack_ms == 5_000
    assert {hash_tag(c.key) for c in plan.calls} | {hash_tag(plan.decision_key)} == {"t:atlas"}


def test_export_concurrency_gate_first_and_decision_record():
    plan = build_plan(NORTHSTAR, req(route="export", cost=2), KB)
    assert [(s.rule.id, s.role) for s in plan.slots] == [("export-tenant", "cc"), ("export-tenant", "rate"),
                                                         ("tenant-atlas-minute", "rate")]
    assert plan.calls[0].key == "rl:v3:{t:atlas}:tenant:atlas:export:cc"
    assert plan.calls[0].params == (3, 60_000, 0, 0, 0)
    assert plan.calls[1].params[3] == 20_000  # costMillis 10,000 x costHint 2
    assert plan.decision_ttl_ms == 30_000


def test_a_decision_record_question_names_tenant_principal_route_and_cost():
    base = build_plan(NORTHSTAR, req(route="export"), KB)
    assert len(base.question) == 16 and base.question.isalnum()
    assert build_plan(NORTHSTAR, req(route="export", rid="r-other-000001"), KB).question == base.question
    others = [req(route="export", tenant="birch"), req(route="export", pid="U-18"), req(route="export", key="K2"),
              req(route="export", key=None), req(route="export", cost=2), req(route="export", ptype="service")]
    assert len({build_plan(NORTHSTAR, r, KB).question for r in others} | {base.question}) == len(others) + 1
    assert KeyBuilder(b"other-pepper").question(tenant="atlas", principal_type="user", principal_id="U-17",
                                                api_key_id="K1", route_group="export", cost_hint=1) != base.question
    assert build_plan(NORTHSTAR, req(), KB).question == ""  # no record, no question


def test_birch_gets_its_own_tenant_rule_and_other_tenants_none():
    assert [r.id for r in build_plan(NORTHSTAR, req(tenant="birch"), KB).rules] == ["read-user-v3",
                                                                                  "tenant-birch-minute"]
    assert [r.id for r in build_plan(NORTHSTAR, req(tenant="cedar"), KB).rules] == ["read-user-v3"]
    assert build_plan(NORTHSTAR, req(tenant="cedar", route="search"), KB).calls == []


def test_anonymous_window_cost_in_units_and_ip_tag():
    plan = build_plan(NORTHSTAR, req(tenant=None, ptype="anonymous", pid="203.0.113.9", route="login", cost=2,
                                     key=None), KB)
    assert [r.id for r in plan.rules] == ["anon-login"]
    assert plan.calls[0].kind == "fw" and plan.calls[0].params == (20, 10_000, 2, 0, 0)
    assert hash_tag(plan.calls[0].key) == hash_tag(plan.decision_key) and hash_tag(plan.decision_key).startswith("ip:")
    assert plan.anonymous


def test_identity_errors_are_validation_failures():
    with pytest.raises(ValidationFailed):
        build_plan(NORTHSTAR, req(tenant=None), KB)  # tenant required for users
    with pytest.raises(ValidationFailed):
        build_plan(NORTHSTAR, req(tenant=None, ptype="anonymous", pid="nope", route="login", key=None), KB)
    with pytest.raises(ValidationFailed):
        build_plan(NORTHSTAR, req(rid="abcdefgh\n"), KB)
    with pytest.raises(ValidationFailed):
        build_plan(NORTHSTAR, req(tenant="atlas\n"), KB)


def test_shadow_rules_and_pools():
    pools = [Pool(id="p-global", window_ms=60_000, limit=40_000), Pool(id="p-atlas", window_ms=60_000, limit=500)]
    extra = [
        Rule(id="shadow-route", scope="route", route_group="read", algorithm="sliding_log", limit=5, window_ms=1_000,
             fail_mode="open", shadow=True),
        Rule(id="global-read", scope="global", route_group="read", algorithm="pool", pool="p-global", cost=2,
             fail_mode="closed"),
        Rule(id="atlas-pool", scope="tenant", tenant="atlas", route_group="read", algorithm="pool", pool="p-atlas",
             fail_mode="closed"),
    ]
    b = seal(msgspec.structs.replace(NORTHSTAR, rules=[*NORTHSTAR.rules, *extra], pools=pools))
    plan = build_plan(b, req(cost=3), KB)
    assert [s.rule.id for s in plan.shadow_slots] == ["shadow-route"]
    assert plan.shadow_calls[0].kind == "sl" and plan.shadow_calls[0].params == (5, 1_000, 3, 0, 0)
    assert [(g.rule.id, g.cost) for g in plan.global_spends] == [("global-read", 6)]
    pool_call = next(c for c, s in zip(plan.calls, plan.slots, strict=True) if s.role == "pool")
    assert pool_call.key == "rl:v3:{t:atlas}:pool:p-atlas" and pool_call.params == (3, 0, 0, 0, 0)
    assert "global-read" in [r.id for r in plan.rules] and all(s.rule.id != "global-read" for s in plan.slots)


def test_release_names_the_same_gates():
    keys = cc_keys_for_release(NORTHSTAR, request_tenant="atlas", principal=Principal(type="user", id="U-17"),
                               route_group="export", keys=KB)
    assert keys == [build_plan(NORTHSTAR, req(route="export"), KB).calls[0].key]
    assert cc_keys_for_release(NORTHSTAR, request_tenant="atlas", principal=Principal(type="user", id="U-17"),
                               route_group="read", keys=KB) == []


def test_reported_units():
    read = NORTHSTAR.rules[0]
    anon = next(r for r in NORTHSTAR.rules if r.id == "anon-login")
    assert tokens_limit(read, {}) == 20 and tokens_remaining(read, 19_999) == 19 and tokens_remaining(read, -5) == 0
    assert tokens_limit(anon, {}) == 20 and tokens_remaining(anon, 7) == 7


def test_bundle_type_is_the_contract_one():
    assert isinstance(NORTHSTAR, Bundle) and NORTHSTAR.bundle_version == 42


# --- properties over arbitrary requests --------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TENANTS = st.one_of(st.sampled_from(["atlas", "birch", "cedar"]), st.from_regex(r"[a-z0-9-]{1,32}", fullmatch=True))
ROUTES = st.one_of(st.sampled_from(["read", "export", "login", "search"]),
                   st.from_regex(r"[a-z0-9_-]{1,32}", fullmatch=True))
IPS = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))


@settings(max_examples=150, deadline=None)
@given(tenant=TENANTS, route=ROUTES, ptype=st.sampled_from(["user", "service", "anonymous"]),
       pid=st.text(min_size=1, max_size=64), ip=IPS, key=st.one_of(st.none(), st.text(min_size=1, max_size=64)),
       cost=st.integers(1, 1000))
def test_every_plan_stays_in_one_slot_and_within_bounds(tenant, route, ptype, pid, ip, key, cost):
    r = AdmitRequest(request_id="prop-0000001", tenant_id=None if ptype == "anonymous" else tenant,
                     principal=Principal(type=ptype, id=ip if ptype == "anonymous" else pid, api_key_id=key),
                     route_group=route, cost_hint=cost)
    plan = build_plan(NORTHSTAR, r, KB)
    keys = [c.key for c in plan.calls] + [plan.decision_key]
    assert len({hash_tag(k) for k in keys}) == 1  # one script, one slot
    assert len(plan.calls) <= 8 and len(set(keys)) == len(keys)  # no key listed twice
    for k in keys:
        parts = k.split(":")
        if parts[4] == "u":  # the principal appears only as its keyed hash
            assert parts[5] == KB.h(tenant, "u", pid)
        assert "\n" not in k and " " not in k
    for c, s in zip(plan.calls, plan.slots, strict=True):
        if c.kind == "tb":
            assert c.params[3] == (s.rule.cost_millis or 0) * cost
        elif c.kind in ("fw", "sc", "sl"):
            assert c.params[2] == cost
