"""etcd refusing an agent's policy source (``--policy-etcd``), as an operator meets it: a real etcd
with authentication on and the roles of ``deploy/etcd/leasehold-roles.sh``, a real Redis, and the
agent as a process (``python -m region_agent``) and as an app made in process (the lifespan).

* a start with credentials, a role's read or TLS etcd refuses is refused with one line naming
  what to fix (and no password), exit 2 — it used to start "ready" on its start bundle, log the
  refusal once, and LeaseholdPolicySnapshotOld fired minutes later (docs/decisions/0065);
* an etcd that does not answer does not stop the start (the agent runs on its start bundle);
* at runtime a refusal is ``leasehold_agent_etcd_refused{cause}`` 1 and one line when it starts
  and one when it ends, however many re-reads meet it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient

from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, free_port, make_tls, wait_port
from leasehold.local.services import agent_command
from region_agent.service.app import PolicyEtcdRefused, create_app
from tests.support.agent import PEPPER, make_settings
from tests.support.etcd_auth import PREFIX, AuthEtcd, auth_etcd_cluster
from tests.support.policies import ROOT
from tests.support.waiting import await_until, wait_until

pytestmark = pytest.mark.integration

auth_etcd = pytest.fixture(auth_etcd_cluster)


def _env(password: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
    if password is not None:
        env["LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD"] = password
    return env


def _command(redis_url: str, policy_file: Path, endpoints: str, port: int, **flags: object) -> list[str]:
    return agent_command(redis_url=redis_url, policy=policy_file, region="eu", host=LOOPBACK, port=port,
                         policy_poll_ms=0, auth_disabled=True, lease_warmup=False, policy_etcd=endpoints,
                         policy_etcd_prefix=PREFIX, policy_etcd_reread_ms=200, **flags)


def run_agent(redis_url: str, policy_file: Path, endpoints: str, work: Path, password: str | None = None,
              **flags: object) -> subprocess.CompletedProcess[str]:
    """``python -m region_agent`` expected to refuse its start (bounded: a start would serve)."""
    cmd = _command(redis_url, policy_file, endpoints, free_port(), **flags)
    return subprocess.run(cmd, env=_env(password), capture_output=True, text=True, timeout=60, cwd=work)


def refused(r: subprocess.CompletedProcess[str], says: str, secret: str | None = None) -> None:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("region_agent: refusing to start: "), r.stderr
    assert says in lines[0], r.stderr
    assert "Traceback" not in r.stderr and (secret is None or secret not in r.stderr), r.stderr


def test_refused_credentials_and_a_role_without_the_read_stop_the_start(auth_etcd: AuthEtcd, redis_url: str,
                                                                        policy_file: Path, tmp_path: Path):
    ep = ",".join(auth_etcd.cluster.endpoints)
    wrong = "Wr0ng-etcd-pw"
    refused(run_agent(redis_url, policy_file, ep, tmp_path, password=wrong, policy_etcd_user="agent"),
            "etcd refused the agent's credentials for its policy source (authentication failed for user agent)",
            wrong)
    refused(run_agent(redis_url, policy_file, ep, tmp_path), "--policy-etcd-user is not set")
    refused(run_agent(redis_url, policy_file, ep, tmp_path, password=wrong, policy_etcd_user="nobody"),
            "credentials", wrong)
    auth_etcd.root("role", "revoke-permission", "leasehold-agent", f"{PREFIX}policy/", "--prefix=true")
    refused(run_agent(redis_url, policy_file, ep, tmp_path, password=auth_etcd.passwords["agent"],
                      policy_etcd_user="agent"),
            f"etcd denied the agent's read of {PREFIX}policy/current (user agent)", auth_etcd.passwords["agent"])


def test_a_failing_tls_handshake_stops_the_start(tmp_path: Path, redis_url: str, policy_file: Path):
    tls, rogue = make_tls(tmp_path / "pki"), make_tls(tmp_path / "rogue")
    assert tls.client_cert is not None and tls.client_key is not None
    cluster = EtcdCluster(tmp_path / "etcd-tls", members=1, tls=tls, client_cert_auth=True).start()
    try:
        r = run_agent(redis_url, policy_file, ",".join(cluster.urls), tmp_path, policy_etcd_ca_file=rogue.ca,
                      policy_etcd_cert_file=tls.client_cert, policy_etcd_key_file=tls.client_key)
        refused(r, "the TLS handshake with the policy etcd failed on every endpoint")
    finally:
        cluster.stop()


def test_an_unreachable_etcd_does_not_stop_the_start(tmp_path: Path, redis_url: str, policy_file: Path):
    """An outage of a cluster that was right: the agent starts on its start bundle (by design)."""
    port = free_port()
    agent = Proc("agent-no-etcd", _command(redis_url, policy_file, f"{LOOPBACK}:{free_port()}", port),
                 tmp_path / "agent", env=_env()).start()
    try:
        wait_port(port, proc=agent.popen, timeout=30)
        assert wait_until(lambda: httpx.get(f"http://{LOOPBACK}:{port}/readyz", timeout=2).status_code == 200, 20)
    finally:
        agent.stop()


async def test_the_app_made_in_process_refuses_too(auth_etcd: AuthEtcd, redis_url: str, policy_file: Path):
    settings = make_settings(redis_url, policy_file, policy_etcd=",".join(auth_etcd.cluster.endpoints),
                             policy_etcd_prefix=PREFIX, policy_etcd_user="agent")
    os.environ.pop("LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD", None)
    with pytest.raises(BaseException) as info:  # found in the test client's task group
        async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)):
            pass
    errors: list[BaseException] = [info.value]
    while errors:
        e = errors.pop(0)
        if isinstance(e, PolicyEtcdRefused):
            assert "credentials" in str(e)
            return
        errors.extend(getattr(e, "exceptions", ()))
    raise AssertionError(f"the start raised no PolicyEtcdRefused: {info.value!r}")


def _gauge(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("leasehold_agent_etcd_refused{"):
            out[line.split('cause="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def test_a_read_revoked_at_runtime_is_a_gauge_and_one_line_until_granted_again(
        auth_etcd: AuthEtcd, redis_url: str, policy_file: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD", auth_etcd.passwords["agent"])
    settings = make_settings(redis_url, policy_file, policy_etcd=",".join(auth_etcd.cluster.endpoints),
                             policy_etcd_prefix=PREFIX, policy_etcd_user="agent", policy_etcd_reread_ms=100)
    caplog.set_level(logging.INFO)
    async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
        assert (await agent.get("/readyz")).status_code == 200
        assert _gauge((await agent.get("/metrics")).text) == {"auth": 0, "permission": 0, "nospace": 0, "tls": 0}
        await asyncio.to_thread(auth_etcd.root, "role", "revoke-permission", "leasehold-agent",
                                f"{PREFIX}policy/", "--prefix=true")

        async def refusing() -> bool:
            return _gauge((await agent.get("/metrics")).text)["permission"] == 1.0
        assert await await_until(refusing, within_s=10)
        await asyncio.sleep(1.5)  # ~15 re-reads refused
        said = [r.getMessage() for r in caplog.records if "etcd refuses this client's read calls" in r.getMessage()]
        assert len(said) == 1, said
        await asyncio.to_thread(auth_etcd.cluster.apply_roles, auth_etcd.files, PREFIX)

        async def accepted() -> bool:
            return _gauge((await agent.get("/metrics")).text)["permission"] == 0.0
        assert await await_until(accepted, within_s=10)
        again = [r for r in caplog.records if "etcd accepts this client's read calls again" in r.getMessage()]
        assert len(again) == 1
