"""Privileged bypasses on a real agent process (docs/invariants.md I3, I14): an exempt rule's decisions are
capped by the rule, each allowed one is exactly one audit event (rule, owner, tenant, request id;
never the principal), denials past the cap are counted and rate-limited in the log."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import msgspec

from kernel.bundle import encode_bundle, load_bundle_file, seal
from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_http_ready
from leasehold.local.services import agent_command
from leasehold.local.topology import DEFAULT_POLICY

CAP = 3
PRINCIPAL = "prober-7c1e-secret-id"


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_bypass_decisions_are_audited_once_each_and_stop_at_the_cap(tmp_path: Path, redis_url: str):
    base = load_bundle_file(str(DEFAULT_POLICY))
    rules = [msgspec.structs.replace(r, limit=CAP) if r.exempt else r for r in base.rules]
    policy = tmp_path / "policy.json"
    policy.write_bytes(encode_bundle(seal(msgspec.structs.replace(base, rules=rules))))
    audit = tmp_path / "audit.jsonl"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["LEASEHOLD_AGENT_PEPPER"] = "audit-test-pepper"
    agent = Proc("agent-audit", agent_command(redis_url=redis_url, policy=policy, region="eu", host=LOOPBACK, port=port,
                                              auth_disabled=True, audit_log=audit), tmp_path / "agent", env=env).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http_ready({url: agent}, timeout=30)
        # the cap is a fixed window of one minute aligned on the clock: the probes must not straddle a
        # boundary (on a busy machine a few requests can take seconds), so they start early in a minute
        if time.time() % 60 > 40:
            time.sleep(60 - time.time() % 60 + 0.2)
        with httpx.Client(base_url=url, timeout=5) as c:
            ds = [c.post("/v1/admit", json={"requestId": f"probe-{i:04d}", "tenantId": "northstar-ops",
                                            "principal": {"type": "service", "id": PRINCIPAL},
                                            "routeGroup": "probe"}).json() for i in range(CAP + 3)]
            normal = c.post("/v1/admit", json={"requestId": "birch-0001", "tenantId": "birch",
                                               "principal": {"type": "user", "id": "B-1"}, "routeGroup": "read"})
            assert normal.status_code == 200
            text = c.get("/metrics").text
    finally:
        agent.stop()
    # the cap is enforced: CAP allowed, then 429 from the exempt rule itself
    assert [d["allowed"] for d in ds] == [True] * CAP + [False] * 3
    assert all(d["policyId"] == "ops-probe-bypass" for d in ds)
    assert all(d["httpStatus"] == 429 and d["deniedScope"] == "tenant" for d in ds[CAP:])
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    used = [e for e in events if e["event"] == "bypass"]
    assert [e["requestId"] for e in used] == [f"probe-{i:04d}" for i in range(CAP)]  # exactly one each
    for e in used:
        assert (e["rule"], e["owner"], e["tenant"], e["routeGroup"], e["outcome"]) == (
            "ops-probe-bypass", "sre-oncall", "northstar-ops", "probe", "allowed")
        assert e["policyVersion"] == 42 and e["ts"].endswith("+00:00")
    denied = [e for e in events if e["event"] == "bypass_denied"]
    # three denials within a second or so: the first is logged, the rest folded into `suppressed`
    # (written when its second is over, or at shutdown): every denial is accounted for exactly once
    assert denied and denied[0]["requestId"] == f"probe-{CAP:04d}"
    assert sum(e["requestId"] is not None for e in denied) + sum(e["suppressed"] for e in denied) == 3
    assert len(events) == len(used) + len(denied)  # nothing for the normal tenant's request
    assert PRINCIPAL not in audit.read_text()  # never the principal
    assert metric(text, "leasehold_agent_bypass_decisions_total", rule="ops-probe-bypass", outcome="allowed") == CAP
    assert metric(text, "leasehold_agent_bypass_decisions_total", rule="ops-probe-bypass", outcome="denied") == 3
    assert metric(text, "leasehold_agent_audit_events_total", event="bypass") == CAP
