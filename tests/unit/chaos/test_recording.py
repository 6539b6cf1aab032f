"""Admission answers become history decisions with the pools the bundle says they spend."""

from __future__ import annotations

from chaos.recording import decision_from_admit, straddles_boundary
from kernel.bundle import Bundle, Fallback, Pool, make_rule, seal, validate_bundle

POOL = Pool(id="p-global", window_ms=1_000, limit=100, chunk_max=20, prefetch_ms=200, fallback_per_region=10)
BUNDLE = seal(Bundle(bundle_version=3, published_at="2026-11-29T00:00:00Z", checksum="", pools=[POOL], rules=[
    make_rule(id="tenant-min", scope="tenant", algorithm="token_bucket", fail_mode="local_bounded",
         capacity_millis=10_000, refill_millis=1_000, period_ms=1_000, cost_millis=1_000,
         fallback=Fallback(limit=5, window_ms=1_000)),
    make_rule(id="global-export", scope="global", algorithm="pool", pool="p-global", cost=2, route_group="export",
         fail_mode="local_bounded"),
    make_rule(id="global-shadow", scope="global", algorithm="pool", pool="p-global", route_group="read", shadow=True,
         fail_mode="local_bounded"),
]))


def req(route: str, cost: int = 1) -> dict:
    return {"requestId": "r-1", "tenantId": "atlas", "principal": {"type": "user", "id": "u1", "apiKeyId": None},
            "routeGroup": route, "method": "GET", "costHint": cost, "policyEpoch": 3}


def test_bundle_used_here_is_valid():
    validate_bundle(BUNDLE)


def test_pool_spend_tokens_and_window_come_from_the_bundle_and_send_time():
    d = decision_from_admit(req("export", cost=3), {"allowed": True, "fallback": False}, BUNDLE, region="eu",
                            agent="agent-eu-1", sent_ms=41_990, received_ms=42_004)
    assert [(s.pool, s.tokens, s.window_index, s.lease_id) for s in d.spends] == [("p-global", 6, 41, None)]
    assert d.allowed and not d.fallback and d.recorded_at_ms == 42_004
    assert straddles_boundary(BUNDLE, "p-global", 41_990, 42_004)
    assert not straddles_boundary(BUNDLE, "p-global", 42_001, 42_004)


def test_shadow_and_non_pool_rules_spend_nothing_and_fallback_flags_split():
    d = decision_from_admit(req("read"), {"allowed": True}, BUNDLE, region="eu", agent="a", sent_ms=1, received_ms=2)
    assert d.spends == []
    denied = decision_from_admit(req("export"), {"allowed": False, "reason": "RATE_EXCEEDED", "fallback": True},
                                 BUNDLE, region="us", agent="a", sent_ms=5, received_ms=6)
    assert not denied.allowed and denied.fallback and not denied.local and denied.reason == "RATE_EXCEEDED"
    local = decision_from_admit(req("export"), {"allowed": True, "fallback": True}, BUNDLE, region="us", agent="a",
                                sent_ms=5, received_ms=6, local=True)
    assert local.local and not local.fallback
