"""region_agent.decision.version_check: a gateway's policyEpoch against the bundle version the agent holds."""

from __future__ import annotations

from region_agent.decision.version_check import VersionCheck
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock


def mismatches(m: AgentMetrics, relation: str) -> float:
    return m.registry.get_sample_value("leasehold_agent_policy_epoch_mismatches_total", {"relation": relation}) or 0.0


def check(min_interval_s: float = 1.0) -> tuple[VersionCheck, AgentMetrics, FakeClock, list[int]]:
    m, clock, calls = AgentMetrics(), FakeClock(50.0), []
    return VersionCheck(m, refresh=lambda: calls.append(1), min_interval_s=min_interval_s, clock=clock), m, clock, calls


def test_matching_or_absent_epochs_count_nothing():
    e, m, _, calls = check()
    e.observe(None, 42)
    e.observe(42, 42)
    assert mismatches(m, "gateway_ahead") == mismatches(m, "gateway_behind") == 0 and calls == []


def test_a_gateway_behind_is_counted_without_a_refresh():
    e, m, _, calls = check()
    e.observe(41, 42)
    assert mismatches(m, "gateway_behind") == 1 and calls == [] and e.refreshes == 0


def test_a_gateway_ahead_refreshes_at_most_once_per_interval():
    e, m, clock, calls = check(min_interval_s=1.0)
    e.observe(43, 42)
    e.observe(43, 42)
    clock.t += 0.999
    e.observe(44, 42)
    assert mismatches(m, "gateway_ahead") == 3 and len(calls) == 1  # every request counted, one refresh
    clock.t += 0.001
    e.observe(44, 42)
    assert len(calls) == 2 and e.refreshes == 2


def test_without_a_refresh_source_a_gateway_ahead_is_only_counted():
    m = AgentMetrics()
    e = VersionCheck(m, clock=FakeClock(50.0))
    e.observe(43, 42)
    assert mismatches(m, "gateway_ahead") == 1 and e.refreshes == 0
