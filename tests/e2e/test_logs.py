"""Log lines of the real processes: ``--log-format json`` gives one JSON object per line in one
schema (time, level, logger, message, ids) for the service's own loggers and uvicorn's; the audit
trail of privileged bypasses goes to its own file by default, never into the log."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx

from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_http_ready
from leasehold.local.services import agent_command
from leasehold.local.topology import DEFAULT_POLICY

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _agent(tmp_path: Path, redis_url: str, **settings) -> tuple[Proc, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["LEASEHOLD_AGENT_PEPPER"] = "logs-test-pepper"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = Proc("agent", agent_command(redis_url=redis_url, policy=DEFAULT_POLICY, region="eu", host=LOOPBACK,
                                       port=port, auth_disabled=True, **settings),
                tmp_path / "agent", env=env, cwd=cwd).start()
    url = f"http://{LOOPBACK}:{port}"
    wait_http_ready({url: proc}, timeout=30)
    return proc, url


def _probe(c: httpx.Client, i: int) -> dict:
    r = c.post("/v1/admit", json={"requestId": f"logs-probe-{i:04d}", "tenantId": "northstar-ops",
                                  "principal": {"type": "service", "id": "prober-7"}, "routeGroup": "probe"})
    assert r.status_code == 200, r.text
    return r.json()


def test_json_logs_have_one_schema_and_the_audit_trail_has_its_own_file(tmp_path: Path, redis_url: str):
    proc, url = _agent(tmp_path, redis_url, log_format="json", access_log=True)
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            d = _probe(c, 1)
            assert d["allowed"] and d["policyId"] == "ops-probe-bypass" and d["source"] == "script"
            assert c.get("/healthz").status_code == 200
    finally:
        proc.stop()
    assert proc.log_path is not None
    lines = [ln for ln in proc.log_path.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    for rec in records:
        assert {"time", "level", "logger", "message"} <= set(rec), rec
        assert TIME.match(rec["time"]) and rec["level"] in ("debug", "info", "warning", "error", "critical")
    loggers = {rec["logger"] for rec in records}
    assert "region_agent" in loggers and "uvicorn.error" in loggers and "uvicorn.access" in loggers
    assert any("starting region agent" in rec["message"] for rec in records)
    # the bypass is audited in the default audit file of the working directory, not in the log
    audit = tmp_path / "cwd" / "leasehold-audit.jsonl"
    events = [json.loads(ln) for ln in audit.read_text().splitlines()]
    assert [e["requestId"] for e in events if e["event"] == "bypass"] == ["logs-probe-0001"]
    assert not any("logs-probe-0001" in ln for ln in lines if '"uvicorn.access"' not in ln)


def test_the_access_log_names_the_socket_peer_whatever_forwarded_headers_a_client_sends(tmp_path: Path,
                                                                                         redis_url: str):
    """The agent runs without uvicorn's proxy-headers layer (kernel.httpserver.serve, proxy_headers=False):
    a loopback client's X-Forwarded-For / X-Forwarded-Proto change nothing in the request's scope."""
    proc, url = _agent(tmp_path, redis_url, log_format="json", access_log=True)
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            r = c.get("/healthz", headers={"x-forwarded-for": "198.51.100.77", "x-forwarded-proto": "https"})
            assert r.status_code == 200
    finally:
        proc.stop()
    assert proc.log_path is not None
    access = [json.loads(ln) for ln in proc.log_path.read_text().splitlines()
              if ln.strip() and '"uvicorn.access"' in ln and "/healthz" in ln]
    assert access, "no access log line for the probe"
    assert all("198.51.100.77" not in json.dumps(rec) for rec in access)
    assert any(LOOPBACK in json.dumps(rec) for rec in access)


def test_text_logs_stay_the_default(tmp_path: Path, redis_url: str):
    proc, url = _agent(tmp_path, redis_url)
    proc.stop()
    assert proc.log_path is not None
    text = proc.log_path.read_text()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO region_agent: starting region agent", text, re.M)
    assert not any(ln.startswith("{") for ln in text.splitlines())
