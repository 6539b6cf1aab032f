"""The agent's canary rule (region_agent.service.policy.PolicyHolder.offer_canary): what it holds, which
bundle each request gets, and that no request of a tenant is ever evaluated with a lower version
than an earlier one of the same tenant on this agent."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import load_bundle_file, seal
from kernel.policy_store import Slice, StoredCanary
from region_agent.service.policy import PolicyHolder

NS = Path(__file__).resolve().parents[4] / "policies" / "northstar.json"
BASE = load_bundle_file(str(NS))


def v(n: int, burst: int = 20):
    rules = [msgspec.structs.replace(r, capacity_millis=burst * 1000) if r.id == "read-user-v3" else r
             for r in BASE.rules]
    return seal(msgspec.structs.replace(BASE, bundle_version=n, rules=rules))


def staged(bundle, **slice_) -> StoredCanary:
    return StoredCanary(b"", 1, Slice(**slice_), 42, bundle)


def holder() -> tuple[PolicyHolder, list]:
    h = PolicyHolder(str(NS), v(43))
    h.region, h.agent_id = "eu", "agent-eu-1"
    events: list = []
    h.on_canary = lambda outcome, version: events.append((outcome, version))
    return h, events


def versions(h: PolicyHolder) -> dict:
    return {t: h.bundle_for(t).bundle_version for t in ("atlas", "birch", None)}


def test_agent_and_region_slices_take_every_request_others_none():
    h, ev = holder()
    assert h.offer_canary(staged(v(44), regions=["eu"])) == "accepted"
    assert versions(h) == {"atlas": 44, "birch": 44, None: 44} and ("set", 44) in ev
    h2, _ = holder()
    assert h2.offer_canary(staged(v(44), regions=["us"], agents=["agent-us-1"])) == "none"
    assert versions(h2) == {"atlas": 43, "birch": 43, None: 43}


def test_a_tenant_slice_picks_per_request_and_only_widens():
    h, _ = holder()
    assert h.offer_canary(staged(v(44), tenants=["atlas"])) == "accepted"
    assert versions(h) == {"atlas": 44, "birch": 43, None: 43}
    # narrowing (atlas would go back to 43) or replacing by another tenant is kept out
    assert h.offer_canary(staged(v(44), tenants=["birch"])) == "kept"
    assert h.offer_canary(None) == "kept"  # the key removed without promote or rollback
    assert versions(h) == {"atlas": 44, "birch": 43, None: 43}
    # a lower candidate, or another bundle under the same version, is kept out too
    assert h.offer_canary(staged(v(44, burst=5), tenants=["atlas"])) == "kept"
    # widening is accepted; so is a higher candidate for at least the same tenants
    assert h.offer_canary(staged(v(44), tenants=["atlas", "birch"])) == "accepted"
    assert versions(h) == {"atlas": 44, "birch": 44, None: 43}
    assert h.offer_canary(staged(v(45), tenants=["atlas", "birch", "cedar"])) == "accepted"
    assert versions(h) == {"atlas": 45, "birch": 45, None: 43}


def test_promote_and_rollback_end_it_upwards_only():
    h, _ = holder()
    h.offer_canary(staged(v(44), tenants=["atlas"]))
    # a published 44 (promote) drops the candidate: atlas stays at 44, the rest goes to 44
    assert h.offer(v(44)).outcome == "accepted"
    assert h.offer_canary(None) == "none"
    assert versions(h) == {"atlas": 44, "birch": 44, None: 44} and h.candidate is None
    # a rollback is a higher version: 46 over a candidate 45
    h.offer_canary(staged(v(45), regions=["eu"]))
    assert h.offer(v(46)).outcome == "accepted"
    h.offer_canary(None)
    assert versions(h) == {"atlas": 46, "birch": 46, None: 46}
    # a stale candidate (not above the published version) is never taken
    assert h.offer_canary(staged(v(45), regions=["eu"])) == "none" and h.candidate is None


def test_a_canary_that_changes_pools_or_is_invalid_is_refused():
    h, _ = holder()
    bad = StoredCanary(b"x", 2, None, None, None, "checksum mismatch")
    assert h.offer_canary(bad) == "refused"
    from kernel.bundle import Pool
    pooled = seal(msgspec.structs.replace(v(44), pools=[Pool(id="p", window_ms=60_000, limit=5)]))
    assert h.offer_canary(staged(pooled, regions=["eu"])) == "refused" and h.candidate is None


def test_slice_covers():
    assert Slice(regions=["eu", "us"], tenants=["a"]).covers(Slice(regions=["eu"]))
    assert not Slice(tenants=["a"]).covers(Slice(tenants=["b"]))
