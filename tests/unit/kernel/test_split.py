"""A tenant split across k slots (kernel/split.py): the shares, the divided rules, the bundle
field and its validation."""

from __future__ import annotations

import msgspec
import pytest

from kernel.bundle import decode_bundle, encode_bundle, seal
from kernel.errors import PolicyError
from kernel.signing import signed_message
from kernel.split import TenantSplit, divide, share, split_problems
from tests.support.policies import northstar


@pytest.mark.parametrize("total,k", [(1_000_000, 3), (40, 4), (41, 4), (7, 7), (1_000_003, 64)])
def test_shares_add_up_to_the_limit_and_differ_by_at_most_one(total, k):
    shares = [share(total, k, i) for i in range(k)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1
    assert max(shares) == -(-total // k) and min(shares) == total // k
    assert shares == sorted(shares, reverse=True)  # the remainder goes to the first sub-buckets


def _rule(rule_id: str):
    return next(r for r in northstar().rules if r.id == rule_id)


def test_a_tenant_rule_is_divided_and_a_user_rule_is_not():
    tenant, user = _rule("tenant-atlas-minute"), _rule("read-user-v3")
    parts = [divide(tenant, 3, i) for i in range(3)]
    assert [p.capacity_millis for p in parts] == [333_334, 333_333, 333_333]
    assert [p.refill_millis for p in parts] == [333_334, 333_333, 333_333]
    assert {p.period_ms for p in parts} == {60_000} and {p.cost_millis for p in parts} == {1000}
    assert [p.fallback.capacity_millis for p in parts] == [16_667, 16_667, 16_666]
    assert divide(user, 3, 1) is user


def test_a_window_rule_and_a_concurrency_gate_are_divided():
    export = _rule("export-tenant")
    assert [divide(export, 3, i).concurrency_max for i in range(3)] == [1, 1, 1]
    window = msgspec.structs.replace(_rule("anon-login"), scope="tenant", tenant="atlas", limit=41)
    assert [divide(window, 4, i).limit for i in range(4)] == [11, 10, 10, 10]
    assert [divide(window, 4, i).fallback.limit for i in range(4)] == [2, 1, 1, 1]


def _split(bundle, *splits):
    return seal(msgspec.structs.replace(bundle, tenant_splits=list(splits)))


def test_a_bundle_without_splits_keeps_its_bytes_and_checksum():
    b = northstar()
    again = seal(b)
    assert again.checksum == b.checksum
    assert b"tenantSplits" not in encode_bundle(b)
    assert b"tenantSplits" not in signed_message(b)


def test_a_split_is_written_covered_by_checksum_and_signature_and_read_back():
    b = _split(northstar(), TenantSplit("atlas", 3))
    raw = encode_bundle(b)
    assert b'"tenantSplits"' in raw and b'"subBuckets": 3' in raw
    assert decode_bundle(raw).tenant_splits == [TenantSplit("atlas", 3)]
    assert b.checksum != northstar().checksum
    assert b"tenantSplits" in signed_message(b)
    tampered = raw.replace(b'"subBuckets": 3', b'"subBuckets": 2')
    with pytest.raises(PolicyError, match="checksum mismatch"):
        decode_bundle(tampered)


@pytest.mark.parametrize("k", [0, 1, 65, -3])
def test_a_bad_k_is_refused_with_its_range(k):
    with pytest.raises(PolicyError) as e:
        decode_bundle(encode_bundle(_split(northstar(), TenantSplit("birch", k))))
    assert any(f"subBuckets must be an integer from 2 to 64 (got {k})" in p for p in e.value.errors)


def test_a_k_of_the_wrong_type_is_refused_by_the_schema():
    raw = encode_bundle(_split(northstar(), TenantSplit("birch", 2))).replace(b'"subBuckets": 2', b'"subBuckets": "2"')
    with pytest.raises(PolicyError, match=r"tenantSplits\[0\]\.subBuckets"):
        decode_bundle(raw)


def test_a_share_too_small_for_one_request_is_refused():
    # export-tenant: concurrencyMax 3 (a generic rule: it applies to atlas too), 10 tokens per request
    with pytest.raises(PolicyError) as e:
        decode_bundle(encode_bundle(_split(northstar(), TenantSplit("atlas", 4))))
    assert any("rule 'export-tenant' (tenant scope): concurrencyMax 3 is smaller than subBuckets 4" in p
               for p in e.value.errors)
    rules = [msgspec.structs.replace(_rule("anon-login"), id="w", scope="tenant", tenant="atlas", limit=3,
                                     fallback=None, fail_mode="closed")]
    assert split_problems([TenantSplit("atlas", 4)], rules, {}) == [
        "tenantSplits 'atlas': rule 'w' (tenant scope): limit 3 is smaller than subBuckets 4: a sub-bucket "
        "would admit nothing"]
    bucket = [msgspec.structs.replace(_rule("tenant-atlas-minute"), capacity_millis=3_000)]
    assert any("costMillis 1000 exceeds capacityMillis 750" in p
               for p in split_problems([TenantSplit("atlas", 4)], bucket, {}))


def test_a_split_tenant_twice_an_invalid_tenant_and_a_tenant_pool_are_refused():
    rules = [r for r in northstar().rules if r.id != "export-tenant"]
    assert split_problems([TenantSplit("atlas", 2), TenantSplit("atlas", 3)], rules, {}) == [
        "tenantSplits 'atlas': the tenant is split twice"]
    assert split_problems([TenantSplit("Atlas!", 2)], rules, {})[0].startswith(
        "tenantSplits 'Atlas!': tenant must match")
    from kernel.bundle import load_bundle_file
    from tests.support.policies import ROOT

    glob = load_bundle_file(str(ROOT / "policies" / "northstar-global.json"))
    problems = split_problems([TenantSplit("atlas", 2)], glob.rules, {p.id: p for p in glob.pools})
    assert any("spends pool 'atlas-minute'" in p and "cannot spend a tenant pool" in p for p in problems)


def test_the_sample_splits_atlas_three_ways():
    b = decode_bundle(encode_bundle(_split(northstar(), TenantSplit("atlas", 3))))
    assert b.tenant_splits[0].sub_buckets == 3


def test_the_policy_source_carries_splits_both_ways():
    from kernel.errors import PolicyError as _PolicyError
    from kernel.policy_yaml import compile_text, source_text
    from tests.support.policies import ROOT

    text = (ROOT / "policies" / "northstar.yaml").read_text()
    text = text.replace("rules:", "tenantSplits:\n  - {tenant: birch, subBuckets: 2}\nrules:", 1)
    b = compile_text(text, "split.yaml")
    assert b.tenant_splits == [TenantSplit("birch", 2)]
    assert compile_text(source_text(b), "again.yaml").checksum == b.checksum
    with pytest.raises(_PolicyError, match="subBuckets must be an integer from 2 to 64"):
        compile_text(text.replace("subBuckets: 2", "subBuckets: 1"), "bad.yaml")


def test_an_approximate_rules_local_max_is_divided_with_its_limit():
    from kernel.algorithms import make_rule
    from kernel.algorithms.rule import Approximate

    r = make_rule(id="c", scope="tenant", tenant="atlas", algorithm="fixed_window", fail_mode="local_bounded",
                  limit=1000, window_ms=60_000, approximate=Approximate(reconcile_ms=500, local_max=10))
    parts = [divide(r, 4, i) for i in range(4)]
    assert [p.approximate.local_max for p in parts] == [3, 3, 2, 2] and sum(p.limit for p in parts) == 1000
    small = msgspec.structs.replace(r, approximate=Approximate(reconcile_ms=500, local_max=3))
    assert split_problems([TenantSplit("atlas", 4)], [small], {}) == [
        "tenantSplits 'atlas': rule 'c' (tenant scope): approximate localMax 3 is smaller than subBuckets 4"]


def test_policy_diff_names_a_changed_split():
    from kernel.policy_diff import diff, render

    old = northstar()
    new = _split(msgspec.structs.replace(old, bundle_version=old.bundle_version + 1), TenantSplit("birch", 2))
    lines = render(diff(old, new))
    assert "bundle tenantSplits birch: changed" in lines
    assert any("subBuckets" in line and "1" in line and "2" in line for line in lines)
