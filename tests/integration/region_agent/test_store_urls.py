"""The Redis URL forms of ``--redis-url`` on real servers: a unix socket, a database other than 0
(``/db`` and ``?db=``), the agent's ACL user with a password full of URL delimiters (given in
the environment, as the docs say), and the agent process refusing a password written into the
URL unencoded without echoing any of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import RedisServer, agent_acl
from leasehold.local.services import agent_command
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import ROOT

pytestmark = pytest.mark.integration

PASSWORD = "p@ss/w?rd#%:1"  # every delimiter of a URL


async def decided_in_redis(url: str, policy_file: Path) -> dict:
    app = create_app(make_settings(url, policy_file), pepper=PEPPER)
    async with AsyncTestClient(app=app) as agent:
        resp = await agent.post("/v1/admit", json=admit_body("url-form-0001"))
        assert resp.status_code == 200, resp.text
        return resp.json()


async def test_a_unix_socket_with_the_acl_user_and_a_password_from_the_environment(tmp_path: Path, policy_file: Path,
                                                                                  monkeypatch):
    sock = tmp_path / "redis.sock"
    redis = RedisServer(tmp_path / "unix", admin_password="admin-pw", users=[agent_acl("agent", PASSWORD)],
                        extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")).start()
    monkeypatch.setenv("LEASEHOLD_AGENT_REDIS_PASSWORD", PASSWORD)
    try:
        d = await decided_in_redis(f"unix://agent@{sock}", policy_file)
        assert d["allowed"] and not d["fallback"]  # decided by the script, over the socket
        assert int(redis.cli("DBSIZE")) > 0
    finally:
        redis.stop()


async def test_a_unix_socket_url_without_a_user(tmp_path: Path, policy_file: Path):
    sock = tmp_path / "redis.sock"
    redis = RedisServer(tmp_path / "unix", extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")).start()
    try:
        d = await decided_in_redis(f"unix://{sock}?db=2", policy_file)  # refused as "not a URL" before
        assert d["allowed"] and not d["fallback"]
        assert redis.cli("INFO", "keyspace").splitlines()[1].startswith("db2:")
    finally:
        redis.stop()


@pytest.mark.parametrize("form", ["/{db}", "?db={db}"])
async def test_a_database_other_than_0(tmp_path: Path, policy_file: Path, form: str):
    redis = RedisServer(tmp_path / "db").start()
    try:
        d = await decided_in_redis(f"redis://127.0.0.1:{redis.port}" + form.format(db=5), policy_file)
        assert d["allowed"] and not d["fallback"]
        assert redis.cli("INFO", "keyspace").splitlines()[1].startswith("db5:")  # only db5 has keys
        assert len(redis.cli("INFO", "keyspace").splitlines()) == 2
    finally:
        redis.stop()


@pytest.mark.parametrize("password", [PASSWORD, "s3cret/x", "s3cret#x"])
def test_an_unencoded_password_in_the_url_is_refused_without_echo(tmp_path: Path, policy_file: Path, password: str):
    """Before: 's3cret/x' was answered "bad port in 'agent:s3cret'", and 's3cret#x' was accepted and
    crashed the start (redis-py read 's3cret' as the port)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
    cmd = agent_command(redis_url=f"redis://agent:{password}@127.0.0.1:6379/0", policy=policy_file, region="eu",
                        host="127.0.0.1", port=0, auth_disabled=True, policy_poll_ms=0, python=sys.executable)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--redis-url" in out.stderr and ("percent-encode" in out.stderr or "%23" in out.stderr)
    assert "Traceback" not in out.stderr
    for piece in ("p@ss", "w?rd", "s3cret", "agent:p", "agent:s"):
        assert piece not in out.stderr + out.stdout, out.stderr
