"""kernel.policy_metrics: the policy-follower metrics of both services, defined once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kernel.policy_metrics import RELOAD_OUTCOMES, policy_metrics


def test_every_reload_outcome_exists_from_the_start_at_zero():
    r = CollectorRegistry()
    reloads, version, age = policy_metrics("agent", r, offered="file or etcd", age="since the last read")
    for outcome in RELOAD_OUTCOMES:
        assert r.get_sample_value("leasehold_agent_policy_reloads_total", {"outcome": outcome}) == 0
    reloads.labels("stale").inc()
    version.set(42)
    age.set(1.5)
    assert r.get_sample_value("leasehold_agent_policy_reloads_total", {"outcome": "stale"}) == 1
    assert r.get_sample_value("leasehold_agent_policy_version") == 42
    assert r.get_sample_value("leasehold_agent_policy_age_seconds") == 1.5


def test_each_service_gets_its_own_names():
    r = CollectorRegistry()
    policy_metrics("agent", r, offered="a", age="b")
    policy_metrics("allocator", r, offered="a", age="b")  # no clash in one registry
    assert r.get_sample_value("leasehold_allocator_policy_version") == 0
