"""A reachable Redis that refuses the agent's commands, on real servers: memory full under
``noeviction`` (every write script answers OOM) and an ACL user missing a command its scripts
need (NOPERM). Either lasts until an operator acts: the decisions degrade by their rules' fail
modes (the bounded local path, never a 500 nor an unbounded allow), the breaker counts the
refusals (LeaseholdBreakerOpen), and one log line names the cause. At start, refused
credentials or a missing permission stop the agent with one line (a deployment error), a full
store does not."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer, agent_acl
from leasehold.local.services import agent_command
from region_agent.service.app import StoreAccessRefused, create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import ROOT

pytestmark = pytest.mark.integration

FAST_BREAKER = dict(breaker_failures=3, breaker_open_ms=200, redis_log_interval_ms=0, store_health_ms=0)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def degraded_with_the_cause(agent: AsyncTestClient, caplog: pytest.LogCaptureFixture, rid: str,
                                  cause: str) -> None:
    """Decisions on the refusing store: the user rule's bounded local allowance (its limit 5,
    never more), degraded as a store failure, and the breaker open with one line naming ``cause``."""
    answers = []
    for i in range(8):
        resp = await agent.post("/v1/admit", json=admit_body(f"{rid}-{i:04d}", pid=f"{rid}-user"))
        assert resp.status_code == 200, resp.text  # a decision, never a 500
        answers.append(resp.json())
    assert all(a["fallback"] for a in answers), answers
    assert sum(a["allowed"] for a in answers) <= 5  # read-user-v3's limit: bounded, never an open door
    assert not answers[-1]["allowed"]
    text = (await agent.get("/metrics")).text
    assert metric(text, "leasehold_agent_degraded_decisions_total", reason="STORE_UNREACHABLE") >= 8, text
    assert metric(text, "leasehold_agent_degraded_decisions_total", reason="POLICY_ERROR") == 0  # not a policy defect
    assert metric(text, "leasehold_agent_script_errors_total", error="StoreRefused") >= 1
    assert metric(text, "leasehold_agent_breaker_state", shard="default") == 2  # LeaseholdBreakerOpen
    lines = [r for r in caplog.records if "refuses the agent's commands" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].levelno == logging.ERROR and cause in lines[0].getMessage()


async def test_a_full_store_under_noeviction_degrades_bounded_and_says_why(tmp_path: Path, policy_file: Path,
                                                                          caplog: pytest.LogCaptureFixture):
    redis = RedisServer(tmp_path / "full").start()
    caplog.set_level(logging.INFO, logger="region_agent")
    try:
        app = create_app(make_settings(redis.url, policy_file, **FAST_BREAKER), pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            ok = (await agent.post("/v1/admit", json=admit_body("oom-before"))).json()
            assert ok["allowed"] and not ok["fallback"]
            redis.cli("CONFIG", "SET", "maxmemory", "1")  # every write refused: OOM
            await degraded_with_the_cause(agent, caplog, "oom", "OOM: used memory above maxmemory")
            redis.cli("CONFIG", "SET", "maxmemory", "0")
            for i in range(200):  # the breaker's half-open probe finds the store writable again
                d = (await agent.post("/v1/admit", json=admit_body(f"oom-after-{i:04d}", pid="after"))).json()
                if not d["fallback"]:
                    break
                await _sleep(0.02)
            assert not d["fallback"] and d["allowed"]
            assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        redis.stop()


async def test_an_acl_user_losing_evalsha_degrades_bounded_and_says_why(tmp_path: Path, policy_file: Path,
                                                                       caplog: pytest.LogCaptureFixture):
    redis = RedisServer(tmp_path / "acl", admin_password="admin-pw", users=[agent_acl("agent", "agent-pw")]).start()
    caplog.set_level(logging.INFO, logger="region_agent")
    try:
        url = f"redis://agent:agent-pw@127.0.0.1:{redis.port}/0"
        app = create_app(make_settings(url, policy_file, **FAST_BREAKER), pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            ok = (await agent.post("/v1/admit", json=admit_body("acl-before"))).json()
            assert ok["allowed"] and not ok["fallback"]
            redis.cli("ACL", "SETUSER", "agent", "-evalsha")  # an ACL change while the agent runs
            await degraded_with_the_cause(agent, caplog, "acl", "NOPERM")
    finally:
        redis.stop()


async def refused_start(url: str, policy_file: Path) -> str:
    """Start an agent app on ``url``: the text of the :class:`StoreAccessRefused` its start raised
    (found in the test client's task group); fails when the start raised none."""
    app = create_app(make_settings(url, policy_file), pepper=PEPPER)
    with pytest.raises(BaseException) as info:
        async with AsyncTestClient(app=app):
            pass
    errors: list[BaseException] = [info.value]
    while errors:
        e = errors.pop(0)
        if isinstance(e, StoreAccessRefused):
            return str(e)
        errors.extend(getattr(e, "exceptions", ()))
    raise AssertionError(f"the start raised no StoreAccessRefused: {info.value!r}")


@pytest.mark.parametrize(("rule", "password", "says"), [
    (agent_acl("agent", "agent-pw"), "not-the-password", "WRONGPASS"),
    (agent_acl("agent", "agent-pw").replace(" +evalsha", ""), "agent-pw", "NOPERM"),  # SCRIPT LOAD alone works
    (agent_acl("agent", "agent-pw").replace(" +time", ""), "agent-pw", "NOPERM"),  # the scripts' clock
    (agent_acl("agent", "agent-pw").replace("~rl:*", "~limits:*"), "agent-pw", "NOPERM"),  # the keys
])
async def test_refused_credentials_or_permissions_stop_the_start(tmp_path: Path, policy_file: Path, rule: str,
                                                                password: str, says: str):
    redis = RedisServer(tmp_path / "acl", admin_password="admin-pw", users=[rule]).start()
    try:
        url = f"redis://agent:{password}@127.0.0.1:{redis.port}/0"
        refused = await refused_start(url, policy_file)
        assert says in refused and password not in refused
    finally:
        redis.stop()


async def test_a_full_store_at_start_is_not_a_refusal(tmp_path: Path, policy_file: Path):
    """OOM passes with time (keys expire, memory is raised): the agent starts, degraded meanwhile."""
    redis = RedisServer(tmp_path / "full", extra_args=("--maxmemory", "1")).start()
    try:
        app = create_app(make_settings(redis.url, policy_file), pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            assert (await agent.get("/readyz")).status_code == 200
            d = (await agent.post("/v1/admit", json=admit_body("full-at-start"))).json()
            assert d["allowed"] and d["fallback"]
    finally:
        redis.stop()


def test_the_agent_process_with_a_wrong_password_exits_with_one_line(tmp_path: Path, policy_file: Path):
    password = "Wr0ng:p@ss/w%rd"  # special characters, quoted in the URL: never echoed
    redis = RedisServer(tmp_path / "acl", admin_password="admin-pw", users=[agent_acl("agent", "agent-pw")]).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
        env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode(), LEASEHOLD_AGENT_REDIS_PASSWORD=password)
        cmd = agent_command(redis_url=f"redis://agent@127.0.0.1:{redis.port}/0", policy=policy_file, region="eu",
                            host="127.0.0.1", port=0, auth_disabled=True, policy_poll_ms=0, python=sys.executable)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]  # as the agent's other refusals: one line, no traceback
        lines = [ln for ln in out.stderr.splitlines() if "refusing to start" in ln]
        assert len(lines) == 1 and lines[0].startswith("region_agent: refusing to start: the regional Redis refused "
                                                      "the agent's Redis credentials (WRONGPASS"), out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        assert "not checked at start" not in out.stderr  # no misleading line before it
        for form in (password, "p@ss", "Wr0ng%3Ap%40ss"):
            assert form not in out.stderr + out.stdout
    finally:
        redis.stop()


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


@pytest.mark.parametrize(("drop", "password", "says"), [
    ("", "not-the-password", "WRONGPASS"),  # the topology read itself is refused
    ("+cluster|slots", "agent-pw", "NOPERM"),
    ("+evalsha", "agent-pw", "NOPERM"),  # topology and SCRIPT LOAD work; the scripts may not run
])
async def test_a_redis_cluster_refusing_the_acl_user_stops_the_start(redis_cluster, redis_cluster_url, policy_file: Path,
                                                                    drop: str, password: str, says: str):
    rule = agent_acl("agent", "agent-pw").split(" ", 1)[1]  # (without the user's name)
    if drop:
        rule = rule.replace(f" {drop}", "")
    nodes = redis_cluster.nodes
    for node in nodes:  # ACLs are per node
        node.cli("ACL", "SETUSER", "agent", "reset", *rule.split())
    try:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        assert says in await refused_start(f"redis+cluster://agent:{password}@{hosts}", policy_file)
    finally:
        for node in nodes:
            node.cli("ACL", "DELUSER", "agent")


async def test_a_redis_cluster_with_the_acl_user_decides(redis_cluster, redis_cluster_url, policy_file: Path):
    nodes = redis_cluster.nodes
    for node in nodes:
        node.cli("ACL", "SETUSER", "agent", "reset", *agent_acl("agent", "agent-pw").split()[1:])
    try:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        app = create_app(make_settings(f"redis+cluster://agent:agent-pw@{hosts}", policy_file), pepper=PEPPER)
        async with AsyncTestClient(app=app) as agent:
            d = (await agent.post("/v1/admit", json=admit_body("cluster-acl-1"))).json()
            assert d["allowed"] and not d["fallback"]
    finally:
        for node in nodes:
            node.cli("ACL", "DELUSER", "agent")


async def test_a_tls_certificate_that_does_not_verify_stops_the_start(tmp_path: Path, policy_file: Path):
    """rediss:// without the CA that signed the server's certificate: no connection is ever made.
    It was "store unreachable" — a start degraded for good, the cause never said."""
    from leasehold.local.procs import make_tls

    redis = RedisServer(tmp_path / "tls", tls=make_tls(tmp_path / "certs")).start()
    try:
        refused = await refused_start(f"rediss://127.0.0.1:{redis.port}/0", policy_file)
        assert "TLS certificate that did not verify" in refused and "--redis-ca-file" in refused
    finally:
        redis.stop()
