"""allocator.control.follow: the bundle the allocator follows in etcd (no network)."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from allocator.control.follow import AllocatorPolicy
from allocator.metrics import AllocatorMetrics
from kernel.bundle import load_bundle_file, seal

GLOBAL = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))


def version(n: int):
    return seal(msgspec.structs.replace(GLOBAL, bundle_version=n))


def reloads(m: AllocatorMetrics, outcome: str) -> float:
    return m.policy_reloads.labels(outcome)._value.get()


def test_the_bundle_in_force_offered_again_is_no_refusal(caplog):
    """Started with the bundle etcd also holds (`leasehold up`, a ConfigMap beside the published
    key), the allocator logged "policy refused (stale): bundle 42 is not newer than 42" and
    counted it (LeaseholdPolicyRefused) at every start."""
    m = AllocatorMetrics()
    used: list = []
    policy = AllocatorPolicy(version(42), used.append, m)
    with caplog.at_level(logging.INFO, logger="allocator.control.follow"):
        assert policy.offer(version(42)) == "unchanged"
    assert caplog.records == [] and reloads(m, "stale") == 0 and used == []
    newer_date = msgspec.structs.replace(version(42), published_at="2030-01-01T00:00:00Z")
    assert policy.offer(newer_date) == "stale" and reloads(m, "stale") == 1  # same version, other content
    assert policy.offer(version(43)) == "accepted" and policy.bundle.bundle_version == 43 and len(used) == 1


def test_a_refusal_the_store_made_is_counted_by_its_outcome(caplog):
    """The watcher's store verifies the signature before it validates: a bundle that does not verify
    reaches the allocator as a refusal with the signature outcome, never validated."""
    m = AllocatorMetrics()
    policy = AllocatorPolicy(version(42), [].append, m)
    with caplog.at_level(logging.WARNING, logger="allocator.control.follow"):
        assert policy.refuse("bundle 43 is unsigned and signatures are required", "unsigned") == "unsigned"
        assert policy.refuse("checksum mismatch") == "invalid"
    assert (reloads(m, "unsigned"), reloads(m, "invalid")) == (1, 1) and policy.bundle.bundle_version == 42
    assert [r.getMessage() for r in caplog.records] == [
        "policy refused (unsigned): bundle 43 is unsigned and signatures are required",
        "policy refused (invalid): checksum mismatch"]
