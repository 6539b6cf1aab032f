"""Log lines of the real processes: ``--log-format json`` gives one JSON object per line in one
schema (time, level, logger, message, ids) for the service's own loggers and uvicorn's; the audit
trail of privileged bypasses goes to its own file by default, never into the log."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx

from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_http_ready
from leasehold.local.services import agent_command
from leasehold.local.topology import DEFAULT_POLICY
from tests.support.waiting import wait_until

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


# a body whose unknown field's name is a forged log record: the refusal's log line names that field
FORGED = "2026-01-01 00:00:00,000 CRITICAL region_agent: FORGED"


def _refused_with_field(url: str, field: str) -> None:
    body = {"requestId": "logs-forge-0001", "tenantId": "atlas", "principal": {"type": "user", "id": "u-1"},
            "routeGroup": "read", field: 1}
    with httpx.Client(base_url=url, timeout=5) as c:
        r = c.post("/v1/admit", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text


def test_a_client_cannot_forge_a_text_log_line_or_drive_the_terminal(tmp_path: Path, redis_url: str):
    """The refusal's line names the unknown field a client sent: its newline, carriage return,
    ESC and line separator are written escaped, so the line stays one line."""
    proc, url = _agent(tmp_path, redis_url)
    try:
        _refused_with_field(url, f"x\n{FORGED}\r\u2028\x1b[2J")
    finally:
        proc.stop()
    assert proc.log_path is not None
    raw = proc.log_path.read_bytes()
    assert b"\x1b" not in raw and "\u2028".encode() not in raw and b"\r" not in raw
    lines = raw.decode().splitlines()
    assert not any(ln.startswith(FORGED) for ln in lines), lines
    refused = [ln for ln in lines if "refused 422 /v1/admit" in ln]
    assert len(refused) == 1 and "x\\n" + FORGED in refused[0] and "\\x1b[2J" in refused[0], refused


def test_a_client_cannot_forge_a_json_log_record(tmp_path: Path, redis_url: str):
    """JSON lines: the separators json.dumps leaves raw (U+2028, U+2029, U+0085; str.splitlines and
    other line readers split on them) are escaped too, so every line is one whole record (a split
    record was two lines of broken JSON)."""
    proc, url = _agent(tmp_path, redis_url, log_format="json")
    try:
        for sep in ("\u2028", "\u2029", "\x85"):
            _refused_with_field(url, f"x{sep}{FORGED}")
            time.sleep(1.05)  # the refusal line is written at most once a second
    finally:
        proc.stop()
    assert proc.log_path is not None
    records = [json.loads(ln) for ln in proc.log_path.read_text().splitlines() if ln.strip()]
    refused = [rec["message"] for rec in records if "refused 422 /v1/admit" in rec["message"]]
    assert len(refused) == 3 and all(m.endswith(f"{FORGED}`") for m in refused), refused


def test_a_flood_of_refused_requests_is_counted_whole_in_a_few_lines(tmp_path: Path, redis_url: str):
    """The refusal line is written at most once a second per route and status; the lines held
    back are counted on the next line, and when none follows (the flood stopped) the last one is
    written with the count once the second is over: lines + counts = requests refused."""
    proc, url = _agent(tmp_path, redis_url)
    sent = 40
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            for i in range(sent):
                r = c.post("/v1/admit", content=b'{"requestId": "flood-0001", "bogus%d": 1}' % i,
                           headers={"content-type": "application/json"})
                assert r.status_code == 422
        # the last line comes from the agent's timer a second after the line before it (later on a
        # loaded machine): wait for the lines to count what was sent (bounded), then stop the agent
        wait_until(lambda: _refusals_counted(_refusal_lines(proc)) >= sent, within_s=15)
    finally:
        proc.stop()
    lines = _refusal_lines(proc)
    assert len(lines) < sent and _refusals_counted(lines) == sent, lines
    assert "bogus39" in lines[-1]  # the last refusal is the one written


def _refusal_lines(proc: Proc) -> list[str]:
    assert proc.log_path is not None
    return [ln for ln in proc.log_path.read_text().splitlines() if "refused 422 /v1/admit" in ln]


def _refusals_counted(lines: list[str]) -> int:
    """The refusals the lines account for: each line, and the ones it says were held back."""
    return len(lines) + sum(int(m.group(1)) for ln in lines
                            if (m := re.search(r"\(\+(\d+) more since the last line\)", ln)))
