"""The series the alert rules read exist before the event they alert on. A counter with labels
has no series until its first increment, and ``increase()`` over a series whose first sample is
already its count reads no increase: a burst between two scrapes that creates the series would
leave an ``increase(...) > 0`` alert silent (deploy/prometheus/alerts.yml)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from region_agent.decision.degraded import DEGRADE_REASON
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.service.metrics import AgentMetrics

ROOT = Path(__file__).resolve().parents[3]


def degrade_reasons() -> set[str]:
    """Every ``reason`` the agent counts a degraded decision under: the store errors' and the
    literal ones of the code (``degradations.labels("REASON", ...)``)."""
    literal = re.compile(r'degradations\.labels\("([A-Z_]+)"')
    found = {m for p in (ROOT / "region_agent").rglob("*.py") for m in literal.findall(p.read_text())}
    return set(DEGRADE_REASON.values()) | found


def test_every_fail_closed_series_is_exported_at_zero_from_the_start():
    """LeaseholdFailClosedActivation (critical) reads
    ``increase(leasehold_agent_degraded_decisions_total{fail_mode="closed"}[5m])``: every reason
    that can answer a fail-closed 503 has its series at 0 before the first one."""
    reasons = degrade_reasons()
    assert {"STORE_UNREACHABLE", "DEADLINE", "ALLOCATOR_UNREACHABLE", "POOL_POLICY_ERROR"} <= reasons
    text = generate_latest(AgentMetrics().registry).decode()
    missing = [r for r in sorted(reasons)
               if f'leasehold_agent_degraded_decisions_total{{fail_mode="closed",reason="{r}"}} 0.0' not in text]
    assert not missing, f"no closed series at 0 for {missing}"


def test_the_gateway_token_refusals_of_forward_auth_are_exported_at_zero_from_the_start():
    """LeaseholdAuthzGatewayRefused and LeaseholdAuthzUnknownCaller read
    ``leasehold_agent_authz_unauthenticated_total{caller="gateway"}`` with ``increase()``/``rate()``:
    its series (and the client's) is at 0 before the first refusal."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    text = generate_latest(registry).decode()
    for caller in ("gateway", "client"):
        assert f'leasehold_agent_authz_unauthenticated_total{{caller="{caller}"}} 0.0' in text, caller


def test_the_gateway_token_refusals_of_rlqs_streams_are_exported_at_zero_from_the_start():
    """LeaseholdRlqsGatewayRefused and LeaseholdRlqsUnknownCaller read
    ``leasehold_agent_rlqs_unauthenticated_total`` with ``increase()``/``rate()``: at 0 before the
    first refused stream."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    assert "leasehold_agent_rlqs_unauthenticated_total 0.0" in generate_latest(registry).decode()


def test_the_rlqs_streams_the_agent_refuses_itself_are_exported_at_zero_from_the_start():
    """LeaseholdRlqsStreamsAtCap reads ``leasehold_agent_rlqs_refused_streams_total{reason="exhausted"}``
    with ``increase()``: every reason's series is at 0 before the first refused stream."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    text = generate_latest(registry).decode()
    for reason in ("not_ready", "exhausted"):
        assert f'leasehold_agent_rlqs_refused_streams_total{{reason="{reason}"}} 0.0' in text, reason
