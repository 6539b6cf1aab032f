"""A split tenant's plans (kernel/split.py, region_agent.decision.plan): one sub-bucket per principal, every
key of the request under its tag, the shared rules divided."""

from __future__ import annotations

import msgspec

from kernel.bundle import seal
from kernel.split import TenantSplit
from region_agent.decision.keys import KeyBuilder, hash_tag
from region_agent.decision.plan import Snapshot, build_plan, cc_keys_for_release
from region_agent.models import AdmitRequest, Principal
from tests.support.policies import northstar

KB = KeyBuilder(b"unit-pepper")
SPLIT = Snapshot(seal(msgspec.structs.replace(northstar(), tenant_splits=[TenantSplit("atlas", 3)])))


def req(pid="U-17", tenant="atlas", route="read", rid="r-9f3a61c2e07b4d18", ptype="user"):
    return AdmitRequest(request_id=rid, tenant_id=tenant, principal=Principal(type=ptype, id=pid, api_key_id="K1"),
                        route_group=route)


def test_every_key_of_a_request_carries_its_principals_sub_bucket_tag():
    plan = build_plan(SPLIT, req(), KB)
    sub = KB.sub_bucket("atlas", "user", "U-17", 3)
    tags = {hash_tag(c.key) for c in plan.calls} | {hash_tag(plan.decision_key)}
    assert tags == {f"t:atlas:{sub}"}
    export = build_plan(SPLIT, req(route="export"), KB)  # an idempotent rule: a decision record
    assert {hash_tag(c.key) for c in export.calls} | {hash_tag(export.decision_key)} == {f"t:atlas:{sub}"}
    assert export.decision_ttl_ms > 0 and not export.decision_key.endswith(":d:-")


def test_a_principal_always_lands_in_the_same_sub_bucket_and_principals_spread():
    subs = {pid: KB.sub_bucket("atlas", "user", pid, 3) for pid in (f"U-{i}" for i in range(300))}
    assert subs == {pid: KB.sub_bucket("atlas", "user", pid, 3) for pid in subs}  # stable
    assert KeyBuilder(b"unit-pepper").sub_bucket("atlas", "user", "U-17", 3) == subs["U-17"]  # another agent
    counts = [list(subs.values()).count(i) for i in range(3)]
    assert min(counts) > 60  # 300 principals over 3 sub-buckets: each gets a fair part (expected 100)


def test_the_tenant_rule_is_divided_and_the_user_rule_is_not():
    plan = build_plan(SPLIT, req(), KB)
    sub = KB.sub_bucket("atlas", "user", "U-17", 3)
    user, tenant = plan.calls
    assert user.params == (20_000, 2_000, 1_000, 1_000, 0)
    expect = 333_334 if sub == 0 else 333_333
    assert tenant.params == (expect, expect, 60_000, 1_000, 0)
    assert tenant.key == f"rl:v3:{{t:atlas:{sub}}}:tenant:atlas:all"


def test_an_unsplit_tenant_keeps_its_one_tag():
    plan = build_plan(SPLIT, req(tenant="birch"), KB)
    assert {hash_tag(c.key) for c in plan.calls} | {hash_tag(plan.decision_key)} == {"t:birch"}


def test_release_finds_the_gates_the_admission_took():
    for pid in ("U-1", "U-2", "U-3", "U-4"):
        plan = build_plan(SPLIT, req(pid=pid, route="export"), KB)
        gates = [c.key for c in plan.calls if c.key.endswith(":cc")]
        p = Principal(type="user", id=pid, api_key_id="K1")
        assert cc_keys_for_release(SPLIT, request_tenant="atlas", principal=p, route_group="export", keys=KB) == gates
        assert plan.calls[0].params[0] == 1  # concurrencyMax 3 split 3 ways
