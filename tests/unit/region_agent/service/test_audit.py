"""region_agent.service.audit: every allowed bypass is one event; denials are throttled per rule yet add
up (events + suppressed) to every denial; a failing sink never fails a decision."""

from __future__ import annotations

import json

import msgspec

from kernel.bundle import make_rule
from region_agent.service.audit import BypassAudit
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock

EXEMPT = make_rule(id="atlas-batch-bypass", scope="tenant", tenant="atlas", algorithm="fixed_window", limit=100,
                   window_ms=60_000, fail_mode="closed", exempt=True, owner="team-billing")


def audit(sink=None) -> tuple[BypassAudit, list[dict], AgentMetrics, FakeClock]:
    lines: list[dict] = []
    m, mono = AgentMetrics(), FakeClock(500.0)
    a = BypassAudit(m, sink or (lambda line: lines.append(json.loads(line))), wall=FakeClock(1_780_000_000.25),
                    clock=mono)
    return a, lines, m, mono


def decide(a: BypassAudit, outcome: str, rid: str, rule=EXEMPT) -> None:
    a.decided(rule, outcome=outcome, tenant="atlas", request_id=rid, version=42, fallback=outcome.startswith("fb"))


def test_each_allowed_bypass_is_one_event_without_the_principal():
    a, lines, m, _ = audit()
    decide(a, "allowed", "r-1")
    decide(a, "allowed", "r-2")
    assert [e["requestId"] for e in lines] == ["r-1", "r-2"]
    assert lines[0] == {"event": "bypass", "ts": "2026-05-28T20:26:40.250+00:00", "rule": "atlas-batch-bypass",
                        "owner": "team-billing", "tenant": "atlas", "routeGroup": EXEMPT.route_key,
                        "requestId": "r-1", "policyVersion": 42, "outcome": "allowed", "fallback": False}
    assert m.registry.get_sample_value("leasehold_agent_bypass_decisions_total",
                                       {"rule": EXEMPT.id, "outcome": "allowed"}) == 2
    assert m.registry.get_sample_value("leasehold_agent_audit_events_total", {"event": "bypass"}) == 2


def test_denials_are_one_event_per_rule_per_second_and_add_up():
    a, lines, _, mono = audit()
    for i in range(5):
        decide(a, "denied", f"r-{i}")
        mono.t += 0.1
    assert [(e["event"], e["requestId"], e["suppressed"]) for e in lines] == [("bypass_denied", "r-0", 0)]
    mono.t = 501.0  # a second after the first denial event
    decide(a, "denied", "r-5")
    assert (lines[-1]["requestId"], lines[-1]["suppressed"]) == ("r-5", 4)
    assert sum(1 + e["suppressed"] for e in lines) == 6  # every denial accounted for


def test_denials_of_another_rule_have_their_own_throttle():
    a, lines, _, _ = audit()
    other = msgspec.structs.replace(EXEMPT, id="birch-bypass", tenant="birch")
    decide(a, "denied", "r-1")
    decide(a, "denied", "r-2", rule=other)
    assert [e["rule"] for e in lines] == ["atlas-batch-bypass", "birch-bypass"]


def test_flush_writes_what_is_still_suppressed_once_the_second_is_over():
    a, lines, _, mono = audit()
    decide(a, "denied", "r-1")
    decide(a, "unavailable", "r-2")
    decide(a, "denied", "r-3")
    a.flush()
    assert len(lines) == 1  # the second is not over yet
    mono.t += 1.0
    a.flush()
    assert lines[-1] == {"event": "bypass_denied", "ts": lines[-1]["ts"], "rule": EXEMPT.id, "requestId": None,
                         "suppressed": 2}
    a.flush(force=True)
    assert len(lines) == 2  # nothing left to write


def test_force_flush_writes_at_once():
    a, lines, _, _ = audit()
    decide(a, "denied", "r-1")
    decide(a, "denied", "r-2")
    a.flush(force=True)
    assert [(e["requestId"], e["suppressed"]) for e in lines] == [("r-1", 0), (None, 1)]


def test_a_failing_sink_is_counted_and_never_raises():
    def broken(line: str) -> None:
        raise OSError("disk full")

    a, _, m, _ = audit(sink=broken)
    decide(a, "allowed", "r-1")
    assert m.registry.get_sample_value("leasehold_agent_audit_write_errors_total") == 1
