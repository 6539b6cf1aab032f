"""The region agent as a real subprocess (``python -m region_agent``) against a real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kernel.bundle import encode_bundle, load_bundle_file, seal
from leasehold.local.procs import Proc, free_port, wait_port
from leasehold.local.services import agent_command
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
NORTHSTAR = ROOT / "policies" / "northstar.json"


@pytest.fixture
def agent_proc(tmp_path: Path, redis_url: str) -> Iterator[tuple[str, Proc, Path]]:
    policy = tmp_path / "policy.json"
    policy.write_bytes(NORTHSTAR.read_bytes())
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = Proc("agent", agent_command(redis_url=redis_url, policy=policy, region="eu", host="127.0.0.1", port=port,
                                       policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=True),
                tmp_path / "agent", env=env).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        yield f"http://127.0.0.1:{port}", proc, policy
    finally:
        proc.stop()


def body(rid: str, **kw) -> dict:
    b = {"requestId": rid, "tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
         "routeGroup": "read", "method": "GET", "costHint": 1}
    b.update(kw)
    return b


def test_agent_subprocess_end_to_end(agent_proc):
    base, proc, policy = agent_proc
    with httpx.Client(base_url=base, timeout=5) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200), proc.tail()
        assert c.get("/healthz").json() == {"status": "ok"}
        decisions = [c.post("/v1/admit", json=body(f"e2e-read-{i:03d}")).json() for i in range(20)]
        assert [d["allowed"] for d in decisions] == [True] * 20
        assert decisions[0]["remaining"] == 19 and decisions[0]["policyVersion"] == 42
        # malformed input: problem+json, never a 500
        bad = c.post("/v1/admit", json=body("e2e-bad-001", tenantId="At}las"))
        assert bad.status_code in (400, 422) and bad.headers["content-type"].startswith("application/problem+json")
        bad = c.post("/v1/admit", content=b"[]", headers={"content-type": "application/json"})
        assert bad.status_code in (400, 422) and bad.json()["status"] == bad.status_code
        batch = c.post("/v1/admit/batch", json={"requests": [body(f"e2e-b-{i:03d}", principal={
            "type": "user", "id": f"U-{i}"}) for i in range(5)]}).json()
        assert [d["decisionId"] for d in batch["decisions"]] == [f"e2e-b-{i:03d}" for i in range(5)]
        assert "leasehold_agent_decisions_total" in c.get("/metrics").text
        assert "/v1/admit" in c.get("/schema/openapi.json").json()["paths"]
        # SIGHUP reload: a higher version is taken, a lower one refused
        b = load_bundle_file(str(policy))
        policy.write_bytes(encode_bundle(seal(msgspec.structs.replace(b, bundle_version=43))))
        proc.signal(signal.SIGHUP)
        assert wait_until(lambda: c.get("/v1/policy").json()["bundleVersion"] == 43), proc.tail()
        policy.write_bytes(encode_bundle(seal(msgspec.structs.replace(b, bundle_version=40))))
        proc.signal(signal.SIGHUP)
        assert wait_until(lambda: 'leasehold_agent_policy_reloads_total{outcome="stale"} 1.0' in c.get("/metrics").text)
        assert c.get("/v1/policy").json()["bundleVersion"] == 43
        d = c.post("/v1/admit", json=body("e2e-after-reload")).json()
        assert d["policyVersion"] == 43
    assert proc.alive()


def test_agent_refuses_to_start_without_pepper_or_with_a_bad_bundle(tmp_path: Path, redis_url: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(agent_command(redis_url=redis_url, policy=NORTHSTAR, auth_disabled=True), env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pepper" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(NORTHSTAR.read_text().replace('"costMillis": 1000', '"costMillis": 30000', 1))
    r = subprocess.run(agent_command(redis_url=redis_url, policy=bad, insecure_dev_pepper=True, auth_disabled=True),
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "checksum mismatch" in r.stderr
