"""A quota bucket as Leasehold's question, and how long an assignment may live
(region_agent.gateways.rlqs_mapping): pure, no Envoy."""

from __future__ import annotations

import pytest

from kernel.bundle import load_bundle_file
from region_agent.decision.plan import Snapshot
from region_agent.gateways.mapping import BadQuestion
from region_agent.gateways.rlqs_mapping import (
    RlqsNames,
    WindowEnd,
    assignment_ttl,
    bucket_key,
    bucket_question,
    fixed_window_end,
    per_request_reason,
)

NAMES = RlqsNames.build()
BUNDLE = load_bundle_file("policies/northstar.json")


def q(**entries: str):
    return bucket_question(NAMES, "leasehold", bucket_key(entries.items()), cost=7, request_id="rlqs-test-0001")


def test_a_verified_identity_and_route_group_is_the_question_at_the_assignments_cost():
    r = q(tenant="atlas", user="U-17", api_key="K1", route_group="read")
    assert (r.tenant_id, r.principal.type, r.principal.id, r.principal.api_key_id, r.route_group, r.cost_hint) == (
        "atlas", "user", "U-17", "K1", "read", 7)
    assert r.client_ip is None and not r.auth_failed  # the address stage is per request (RLS)
    assert q(tenant="atlas", service="batch", route_group="read").principal.type == "service"


@pytest.mark.parametrize(("entries", "reason"), [
    ({"tenant": "atlas", "user": "U-1", "route_group": "read", "unmatched": "true"}, "unknown_key"),
    ({"tenant": "atlas", "user": "U-1", "route_group": "read", "remote_address": "10.0.0.1"}, "unknown_key"),
    ({"tenant": "atlas", "user": "U-1"}, "missing_route_group"),
    ({"user": "U-1", "route_group": "read"}, "missing_tenant"),
    ({"tenant": "atlas", "route_group": "read"}, "missing_principal"),
    ({"tenant": "atlas", "user": "U-1", "service": "s", "route_group": "read"}, "conflicting_principal"),
    ({"tenant": "at las", "user": "U-1", "route_group": "read"}, "bad_value"),
])
def test_refused_never_guessed(entries, reason):
    with pytest.raises(BadQuestion) as e:
        q(**entries)
    assert e.value.reason == reason


def test_another_domain_and_malformed_bucket_ids_are_refused():
    with pytest.raises(BadQuestion) as e:
        bucket_question(NAMES, "other", bucket_key([("tenant", "a"), ("user", "u"), ("route_group", "read")]),
                        cost=1, request_id="rlqs-test-0001")
    assert e.value.reason == "unknown_domain"
    for bad in ([], [(f"k{i}", "v") for i in range(17)], [("tenant", "x" * 300)]):
        with pytest.raises(BadQuestion) as e:
            bucket_key(bad)
        assert e.value.reason == "bad_bucket"
    assert bucket_key([("user", "u"), ("tenant", "t")]) == bucket_key([("tenant", "t"), ("user", "u")])


def test_key_names_are_settings():
    names = RlqsNames.build(keys=["tenant=org"])
    r = bucket_question(names, "leasehold", bucket_key([("org", "atlas"), ("user", "U-1"), ("route_group", "read")]),
                        cost=1, request_id="rlqs-test-0001")
    assert r.tenant_id == "atlas"
    with pytest.raises(BadQuestion):  # the old name is no longer mapped
        bucket_question(names, "leasehold", bucket_key([("tenant", "atlas"), ("user", "U-1"), ("route_group", "read")]),
                        cost=1, request_id="rlqs-test-0001")
    with pytest.raises(ValueError):
        RlqsNames.build(keys=["client_ip=remote_address"])  # not a field a bucket can carry


def rules_of(tenant: str, route: str):
    return Snapshot(BUNDLE).shape(tenant, route, "user", False).enforced


def test_rules_decided_per_request_are_not_leased():
    assert per_request_reason(rules_of("atlas", "read")) is None
    assert per_request_reason(rules_of("atlas", "export")) == "concurrency_rule"  # P-EXPORT's cap of 3
    gl = load_bundle_file("policies/northstar-global.json")
    assert per_request_reason(Snapshot(gl).shape("northstar-ops", "probe", "service", False).enforced) == "exempt_rule"


def test_an_assignment_never_outlives_its_window_and_is_whole_seconds():
    # no window (token buckets): the maximum
    assert assignment_ttl([], max_ttl_s=10, margin_ms=250).seconds == 10
    # a minute window with 7.9 s left: 7.65 s usable -> 7 s
    t = assignment_ttl([WindowEnd(60_000, 7_900)], max_ttl_s=10, margin_ms=250)
    assert (t.seconds, t.clamped) == (7, True) and t.clamp_ms == 7_650
    # the last second of a window: none now, wait for the next window
    t = assignment_ttl([WindowEnd(60_000, 1_100)], max_ttl_s=10, margin_ms=250)
    assert (t.seconds, t.wait_ms) == (0, 1_101)
    # uncertain which window it is (end 0): wait
    assert assignment_ttl([WindowEnd(6_000, 0)], max_ttl_s=10, margin_ms=250).seconds == 0
    # a 1 s window cannot clamp in whole seconds: one second, counted as carry by the bound
    t = assignment_ttl([WindowEnd(1_000, 400)], max_ttl_s=10, margin_ms=250)
    assert (t.seconds, t.clamped) == (1, False)
    # the earliest end wins
    assert assignment_ttl([WindowEnd(60_000, 30_000), WindowEnd(10_000, 4_300)], max_ttl_s=60,
                          margin_ms=250).seconds == 4


def test_fixed_windows_are_aligned_on_the_epoch():
    assert fixed_window_end(10_000, 1_700_000_003_500) == WindowEnd(10_000, 6_500)
