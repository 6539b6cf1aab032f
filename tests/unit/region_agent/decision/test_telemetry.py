"""Decision telemetry (region_agent/decision/telemetry.py, keymeter.py, audit.py, version_check.py): bounded labels,
pruned policy versions, new keys by source class, one audit event per bypass use, policyEpoch."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from prometheus_client import generate_latest

from kernel.bundle import load_bundle_file, seal
from region_agent.decision import keymeter, telemetry
from region_agent.decision.keymeter import NewKeyMeter
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.decision.telemetry import DecisionTelemetry
from region_agent.decision.version_check import VersionCheck
from region_agent.models import AdmitRequest, Decision, Principal
from region_agent.service.audit import BypassAudit
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock

ROOT = Path(__file__).resolve().parents[4]
GLOBAL = load_bundle_file(str(ROOT / "policies" / "northstar-global.json"))
KEYS = KeyBuilder(b"pepper")


def plan_for(tenant: str | None, route: str = "read", pid: str = "U-1", bundle=GLOBAL, rid: str = "req-00000001"):
    principal = Principal(type="user", id=pid) if tenant else Principal(type="anonymous", id="203.0.113.9")
    return build_plan(Snapshot(bundle), AdmitRequest(request_id=rid, tenant_id=tenant, principal=principal,
                                           route_group=route), KEYS)


def decision(plan, version=42, allowed=True, status=200, rule=None) -> Decision:
    return Decision(allowed=allowed, decision_id=plan.request_id, rule_id=rule or (plan.rules[0].id if plan.rules
                                                                                      else None),
                    bundle_version=version, http_status=status)


def text(m: AgentMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_tenant_label_is_named_tenant_other_or_none():
    m = AgentMetrics()
    t = DecisionTelemetry(m)
    for tenant in ("atlas", "zeta-unknown", None):
        p = plan_for(tenant, route="login" if tenant is None else "read")
        t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=0.0, touched_store=False)
    out = text(m)
    assert 'tenant="atlas"' in out and 'tenant="other"' in out and 'tenant="none"' in out
    assert "zeta" not in out and "U-1" not in out and "203.0.113.9" not in out
    assert 'leasehold_agent_decision_seconds_count{outcome="allowed",shard="default"} 3.0' in out


def test_only_two_policy_versions_keep_series():
    m = AgentMetrics()
    t = DecisionTelemetry(m)
    p = plan_for("atlas")
    for v in (42, 43, 44):
        b = seal(msgspec.structs.replace(GLOBAL, bundle_version=v))
        t.decided(p, Snapshot(b), decision(p, version=v), 0.001, now=0.0, touched_store=False)
    out = text(m)
    assert 'policy_version="42"' not in out
    assert 'policy_version="43"' in out and 'policy_version="44"' in out


def test_new_keys_are_counted_once_per_horizon_and_by_class(monkeypatch):
    meter = NewKeyMeter()
    meter.touch([("k1", "principal"), ("k2", "tenant")], now=0.0)
    meter.touch([("k1", "principal")], now=10.0)
    assert meter.counts["principal"] == 1 and meter.counts["tenant"] == 1
    meter.touch([("k1", "principal")], now=31.0)  # rotated: k1 is in the previous generation
    assert meter.counts["principal"] == 1
    meter.touch([("k2", "tenant")], now=95.0)  # untouched for two generations: new again
    assert meter.counts["tenant"] == 2
    monkeypatch.setattr(keymeter, "MAX_PER_GENERATION", 2)
    small = NewKeyMeter()
    small.touch([(f"k{i}", "ip") for i in range(5)], now=0.0)
    small.touch([(f"k{i}", "ip") for i in range(5)], now=1.0)
    assert len(small.cur) == 2 and small.counts["ip"] == 8  # bounded memory; over-counts, never grows


def test_the_decision_path_counts_new_keys_as_the_reference_meter_does():
    """DecisionTelemetry inlines NewKeyMeter.touch (hot path); both must count the same."""
    import random

    rng = random.Random(7)
    m = AgentMetrics()
    t = DecisionTelemetry(m)
    ref = NewKeyMeter()
    now = 0.0
    for i in range(3_000):
        now += rng.random() * 0.05
        p = plan_for(rng.choice(["atlas", "birch", "zeta"]), pid=f"U-{rng.randint(1, 300)}", rid=f"req-{i:08d}")
        t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=now, touched_store=True)
        ref.touch([(c.key, keymeter.source_class(s.role, s.rule.scope)) for c, s in zip(p.calls, p.slots, strict=True)], now)
    assert m.new_keys.counts == ref.counts and sum(ref.counts.values()) > 300


@pytest.mark.parametrize("cap", [keymeter.MAX_PER_GENERATION, 40])
def test_remembered_questions_count_new_keys_as_the_reference_meter_does(monkeypatch, cap):
    """A remembered question's calls (one list shared by its askings) whose keys are all in the
    current generation skip the per-key lookups (NewKeyMeter.held): the counts stay the reference
    meter's across rotations, a full generation (``cap``: keys past it are not remembered, so they
    are counted again) and plans asked once."""
    import random

    monkeypatch.setattr(keymeter, "MAX_PER_GENERATION", cap)
    monkeypatch.setattr(telemetry, "MAX_PER_GENERATION", cap)
    rng = random.Random(11)
    m = AgentMetrics()
    t = DecisionTelemetry(m)
    ref = NewKeyMeter()
    snap = Snapshot(GLOBAL)
    now, held = 0.0, 0
    for i in range(4_000):
        now += rng.random() * 0.05
        tenant = rng.choice(["atlas", "birch", "zeta"])
        req = AdmitRequest(request_id=f"req-{i:08d}", tenant_id=tenant, route_group=rng.choice(["read", "export"]),
                           principal=Principal(type="user", id=f"U-{rng.randint(1, 60)}"))
        p = build_plan(snap, req, KEYS)
        t.decided(p, snap, decision(p), 0.001, now=now, touched_store=True)
        ref.touch([(c.key, keymeter.source_class(s.role, s.rule.scope)) for c, s in zip(p.calls, p.slots, strict=True)], now)
        ref.counts["decision"] += p.decision_ttl_ms > 0 and bool(p.calls)
        held += id(p.calls) in m.new_keys.held
    assert m.new_keys.counts == ref.counts and sum(ref.counts.values()) > 100
    assert held > (1_000 if cap > 40 else 0)  # (the path was taken)


def test_decision_keys_feed_the_meter_with_their_class():
    m = AgentMetrics()
    t = DecisionTelemetry(m)
    p = plan_for("atlas", route="export")  # user bucket? no: tenant rule with a concurrency gate, idempotent
    t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=0.0, touched_store=True)
    counts = m.new_keys.counts
    assert counts["concurrency"] == 1 and counts["tenant"] == 1 and counts["decision"] == 1
    t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=1.0, touched_store=False)  # no script ran: nothing new
    assert counts["tenant"] == 1


def test_each_allowed_bypass_is_one_audit_event_and_denials_are_rate_limited():
    m = AgentMetrics()
    lines: list[str] = []
    clock = FakeClock(100.0)
    t = DecisionTelemetry(m, audit=BypassAudit(m, lines.append, clock=clock))
    for i in range(3):
        p = plan_for("northstar-ops", route="probe", pid="OPS-SECRET-USER", rid=f"probe-{i:04d}")
        t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=0.0, touched_store=True)
    for i in range(3, 8):
        p = plan_for("northstar-ops", route="probe", pid="OPS-SECRET-USER", rid=f"probe-{i:04d}")
        t.decided(p, Snapshot(GLOBAL), decision(p, allowed=False, status=429), 0.001, now=0.0, touched_store=True)
    clock.t += 1.5
    p = plan_for("northstar-ops", route="probe", rid="probe-0008")
    t.decided(p, Snapshot(GLOBAL), decision(p, allowed=False, status=429), 0.001, now=0.0, touched_store=True)
    events = [json.loads(x) for x in lines]
    allowed = [e for e in events if e["event"] == "bypass"]
    assert [e["requestId"] for e in allowed] == ["probe-0000", "probe-0001", "probe-0002"]
    assert {(e["rule"], e["owner"], e["tenant"], e["routeGroup"]) for e in allowed} == {
        ("ops-probe-bypass", "sre-oncall", "northstar-ops", "probe")}
    denials = [e for e in events if e["event"] == "bypass_denied"]
    assert [(e["requestId"], e["suppressed"]) for e in denials] == [("probe-0003", 0), ("probe-0008", 4)]
    p = plan_for("northstar-ops", route="probe", rid="probe-0009")
    t.audit.decided(p.rules[0], outcome="denied", tenant="northstar-ops", request_id="probe-0009", version=42,
                    fallback=False)  # within the second of probe-0008: suppressed ...
    t.audit.flush()
    assert len(lines) == 5  # ... not yet written
    clock.t += 1.0
    t.audit.flush()  # the second is over: the pending count is written, without a request id
    assert json.loads(lines[-1]) | {"ts": None} == {"event": "bypass_denied", "ts": None, "rule": "ops-probe-bypass",
                                                   "requestId": None, "suppressed": 1}
    lines.pop()
    assert "OPS-SECRET-USER" not in "".join(lines)  # never the principal
    out = text(m)
    assert 'leasehold_agent_bypass_decisions_total{outcome="allowed",rule="ops-probe-bypass"} 3.0' in out
    assert 'leasehold_agent_bypass_decisions_total{outcome="denied",rule="ops-probe-bypass"} 7.0' in out
    assert 'leasehold_agent_audit_events_total{event="bypass"} 3.0' in out
    # a normal tenant's decisions are not bypasses
    p = plan_for("atlas")
    t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=0.0, touched_store=True)
    assert len(lines) == 5


def test_a_failing_audit_sink_is_counted_and_does_not_raise():
    m = AgentMetrics()

    def broken(_line: str) -> None:
        raise OSError("disk full")
    t = DecisionTelemetry(m, audit=BypassAudit(m, broken))
    p = plan_for("northstar-ops", route="probe")
    t.decided(p, Snapshot(GLOBAL), decision(p), 0.001, now=0.0, touched_store=True)
    assert "leasehold_agent_audit_write_errors_total 1.0" in text(m)


def test_policy_epoch_ahead_refreshes_at_most_once_per_interval():
    m = AgentMetrics()
    clock = FakeClock(100.0)
    calls: list[int] = []
    e = VersionCheck(m, refresh=lambda: calls.append(1), min_interval_s=1.0, clock=clock)
    e.observe(None, 42)
    e.observe(42, 42)
    e.observe(41, 42)
    for _ in range(5):
        e.observe(43, 42)
    clock.t += 1.1
    e.observe(43, 42)
    assert len(calls) == 2
    out = text(m)
    assert 'leasehold_agent_policy_epoch_mismatches_total{relation="gateway_ahead"} 6.0' in out
    assert 'leasehold_agent_policy_epoch_mismatches_total{relation="gateway_behind"} 1.0' in out


def test_counts_kept_outside_the_registry_read_as_per_decision_updates_would():
    """DecisionTelemetry counts in plain Python and moves the counts in when the registry is
    collected: the exposition must equal prometheus_client's own per-decision inc/observe (this
    also catches a prometheus_client whose histogram internals changed)."""
    m, ref = AgentMetrics(), AgentMetrics()
    t = DecisionTelemetry(m)
    p = plan_for("atlas")
    seconds = [0.0, -0.001, 0.0005, 0.0007, 0.001, 0.003, 0.02, 0.2, 0.9, 1.0, 7.5]
    for i, s in enumerate(seconds):
        d = decision(p, allowed=i % 3 != 0, status=200 if i % 3 else 429)
        t.decided(p, Snapshot(GLOBAL), d, s, now=0.0, touched_store=False)
        outcome = "allowed" if d.allowed else "denied"
        ref.decisions.labels(outcome, p.rules[0].id, "42", p.rules[0].route_key, "atlas", "script").inc()
        ref.latency.labels("default", outcome).observe(max(s, 0.0))

    def lines(x: AgentMetrics) -> list[str]:
        return sorted(ln for ln in text(x).splitlines() if "decision" in ln and not ln.startswith("#")
                      and "new_keys" not in ln)

    assert lines(m) == lines(ref) and any("_bucket" in ln for ln in lines(m))
    assert lines(m) == lines(ref)  # a second collection adds nothing
    t.decided(p, Snapshot(GLOBAL), decision(p), 0.004, now=0.0, touched_store=False)
    assert m.registry.get_sample_value("leasehold_agent_decision_seconds_count",
                                       {"shard": "default", "outcome": "allowed"}) == 8.0


def test_a_store_admission_counted_by_its_shapes_parts_reads_as_counted_by_its_label():
    """The engine hands a store admission's shape parts (plan.Shape.admitted) to the telemetry,
    which then finds its counts by them instead of by a label built per decision: the exposition
    is the one the label path makes, across tenants (a named one, another, an anonymous caller),
    two bundle versions, collections in between and a denial of the same shape."""
    from region_agent.decision.record import admitted_reply

    def run(hinted: bool) -> list[list[str]]:
        m = AgentMetrics()
        collected = []
        t = DecisionTelemetry(m)
        seconds = iter([0.0002 * (i % 9) for i in range(1000)])
        for version in (GLOBAL, seal(msgspec.structs.replace(GLOBAL, bundle_version=GLOBAL.bundle_version + 1))):
            snap = Snapshot(version)
            for rnd in range(3):
                for tenant, route in (("atlas", "read"), ("zeta", "read"), (None, "login")):
                    for i in range(4):
                        plan = build_plan(snap, AdmitRequest(
                            request_id=f"req-{rnd}-{i:08d}", tenant_id=tenant, route_group=route,
                            principal=Principal(type="user", id=f"U-{i}") if tenant
                            else Principal(type="anonymous", id="203.0.113.9")), KEYS)
                        parts = plan.shape.admitted
                        assert parts is not None
                        d = admitted_reply(plan, snap, [1, 0, 0, *(5,) * len(plan.calls)])
                        assert d is not None
                        t.decided(plan, snap, d, next(seconds), now=0.0, touched_store=True,
                                  admitted=parts if hinted else None)
                    denied = decision(plan, version=version.bundle_version, allowed=False, status=429)
                    t.decided(plan, snap, denied, next(seconds), now=0.0, touched_store=True,
                              admitted=None)
                collected.append(sorted(ln for ln in text(m).splitlines()  # a collection after each round
                                        if ln.startswith(("leasehold_agent_decision", "leasehold_agent_new_keys"))
                                        and "_created" not in ln))
        return collected

    hinted, plain = run(True), run(False)
    assert hinted == plain
    last = hinted[-1]
    assert any('outcome="allowed"' in ln and 'tenant="other"' in ln for ln in last)
    assert any('outcome="allowed"' in ln and 'tenant="atlas"' in ln for ln in last)
    assert any('outcome="allowed"' in ln and 'tenant="none"' in ln for ln in last)
