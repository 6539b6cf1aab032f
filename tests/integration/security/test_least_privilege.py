"""Least privilege on real servers: Redis with ACLs on (the agent's user runs its scripts on
``rl:*`` keys and nothing else; the default user is password-protected), etcd with
authentication on (the allocator's role limited to its prefix, agents read-only on the policy
key), and TLS to Redis (rediss:// with a throwaway CA) and HTTPS for the agent process."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis
from litestar.testing import AsyncTestClient

from kernel.bundle import Pool, encode_bundle, load_bundle_file, seal
from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore, SigningMarker
from leasehold.commands.cli import main as cli_main
from leasehold.local.procs import (
    ETCD_USERS,
    EtcdCluster,
    Proc,
    RedisServer,
    agent_acl,
    etcd_roles_script,
    free_port,
    make_tls,
    wait_port,
)
from leasehold.local.services import agent_command
from leasehold.local.topology import DEFAULT_POLICY, DEV_PEPPER
from region_agent.decision.keys import KeyBuilder
from region_agent.service.app import create_app
from region_agent.service.settings import DEV_PEPPER as AGENT_DEV_PEPPER
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.allocator_app import in_process, lease_body, settings_for
from tests.support.etcd_auth import auth_etcd_cluster
from tests.support.policies import ROOT, write_pools
from tests.support.waiting import await_until

AGENT_PW = secrets.token_urlsafe(16)
ADMIN_PW = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("acl-redis"), admin_password=ADMIN_PW,
                         users=[agent_acl("agent", AGENT_PW)]).start()
    yield server
    server.stop()


def agent_url(server: RedisServer) -> str:
    return f"redis://agent@127.0.0.1:{server.port}/0"  # the password comes from the environment


async def test_agent_runs_with_its_acl_user_only(acl_redis, policy_file, monkeypatch):
    acl_redis.cli("FLUSHALL")
    monkeypatch.setenv("LEASEHOLD_AGENT_REDIS_PASSWORD", AGENT_PW)
    settings = make_settings(agent_url(acl_redis), policy_file)
    async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
        assert (await agent.get("/readyz")).status_code == 200
        assert (await agent.get("/v1/health/store")).json()["store"] == "reachable"  # the ACL user's PING
        ds = [(await agent.post("/v1/admit", json=admit_body(f"acl-{i:06d}"))).json() for i in range(3)]
        assert [d["allowed"] for d in ds] == [True] * 3 and ds[-1]["remaining"] == 17
        exp = (await agent.post("/v1/admit", json=admit_body("acl-export-1", route="export"))).json()
        assert exp["allowed"] and not exp["fallback"]  # concurrency gate + tenant bucket under the ACL
        anon = admit_body("acl-anon-01", tenant=None, ptype="anonymous", pid="192.0.2.1", route="login", api_key=None)
        assert (await agent.post("/v1/admit", json=anon)).json()["allowed"]
    as_agent = redis.Redis(host="127.0.0.1", port=acl_redis.port, username="agent", password=AGENT_PW)
    for cmd in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("SET", "other:key", "1"),
                ("GET", "secret"), ("DEL", "rl:v3:x"), ("ACL", "LIST"), ("SCRIPT", "FLUSH")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_agent.execute_command(*cmd)
    with pytest.raises(redis.exceptions.NoPermissionError):  # a script touching a non-rl key is refused too
        as_agent.eval("return redis.call('SET', KEYS[1], 1)", 1, "other:key")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=acl_redis.port).ping()  # default user needs its password
    assert int(acl_redis.cli("DBSIZE")) > 0 and acl_redis.cli("EXISTS", "other:key") == "0"


# -- etcd authentication ---------------------------------------------------------------------------
@pytest.fixture
def auth_etcd(tmp_path) -> Iterator[tuple[EtcdCluster, dict[str, str]]]:
    """etcd with the roles of deploy/etcd/leasehold-roles.sh (the script itself, as `leasehold up`
    and the deploy manifests run it), run twice."""
    for etcd in auth_etcd_cluster(tmp_path):
        etcd.cluster.apply_roles(etcd.files)  # idempotent: a second run (authenticated as root) changes nothing
        yield etcd.cluster, etcd.passwords


async def _refused(coro) -> None:
    with pytest.raises(LeaseholdError):
        await coro


async def test_etcd_roles_publisher_allocator_and_agents(auth_etcd, tmp_path, monkeypatch):
    """Least privilege: only the publisher writes the policy key; the allocator writes pools, grants
    and its leader key and only reads the policy; the agents only read the policy; nobody anonymous."""
    cluster, pw = auth_etcd
    ep = ",".join(cluster.endpoints)
    bundle_path = write_pools(tmp_path / "b.json", [Pool(id="p1", window_ms=60_000, limit=100, chunk_max=50)])
    stores = {u: EtcdStore(ep, timeout_s=2, user=u, password=pw[u]) for u in ("publisher", "allocator", "agent")}
    anonymous = EtcdStore(ep, timeout_s=2)
    policy = {u: PolicyStore(s, "/leasehold/") for u, s in stores.items()}
    bundle = seal(load_bundle_file(str(bundle_path)))  # the allocator's own pools, version 1
    newer = encode_bundle(seal(msgspec.structs.replace(bundle, bundle_version=99)))
    try:
        await _refused(anonymous.get(b"/leasehold/policy/current"))
        await _refused(policy["allocator"].publish(encode_bundle(bundle)))  # the allocator cannot publish
        await _refused(policy["agent"].publish(encode_bundle(bundle)))
        await policy["publisher"].publish(encode_bundle(bundle))
        # the signing marker (which keys publish checks against) is the publisher's too, and only its
        marker = SigningMarker(keys={"0123456789abcdef": "b64-public-key"})
        await policy["publisher"].write_signing(marker)
        assert await policy["publisher"].read_signing() == marker
        await _refused(policy["allocator"].write_signing(None))
        await _refused(policy["agent"].write_signing(None))
        for u in ("allocator", "agent", "publisher"):
            stored = await policy[u].read()
            assert stored is not None and stored.bundle.bundle_version == bundle.bundle_version
        await _refused(policy["allocator"].publish(newer))
        for user in ("agent", "publisher"):  # neither writes what the allocator owns
            s = stores[user]
            for key in (b"/leasehold/pools/p1/0", b"/leasehold/grants/x-00000001", b"/leasehold/leader"):
                await _refused(s.put(key, b"x"))
        await _refused(stores["agent"].get(b"/leasehold/leader"))  # agents read the policy only
        await _refused(stores["publisher"].get(b"/leasehold/grants/x-00000001"))
        for key in (b"/leasehold/policy/other", b"/leasehold/other", b"/other/key"):  # nobody writes elsewhere
            for s in stores.values():
                await _refused(s.put(key, b"x"))
        assert await stores["allocator"].put(b"/leasehold/pools/p9/0", b"{}")  # its own keys: fine
        # a real allocator with its etcd user elects itself, grants leases and follows the policy
        monkeypatch.setenv("LEASEHOLD_ALLOCATOR_ETCD_PASSWORD", pw["allocator"])
        settings = settings_for(cluster, bundle_path, "/leasehold/", etcd_user="allocator")
        async with in_process(settings) as client:
            grant = await client.post("/v1/leases", json=lease_body("lease-auth-0001", "p1", "eu", 10))
            assert grant.status_code == 200 and grant.json()["granted"] == 10
            assert (await client.get("/v1/leases/lease-auth-0001?region=eu")).json()["grant"]["granted"] == 10
        # sharded (--shards 4), the same user: shard count, membership and leader/<shard> keys
        sharded = settings_for(cluster, bundle_path, "/leasehold/", etcd_user="allocator", shards=4)
        async with in_process(sharded) as client:
            async def granted() -> bool:
                r = await client.post("/v1/leases", json=lease_body("lease-auth-0002", "p1", "eu", 10))
                return r.status_code == 200 and r.json()["granted"] == 10
            assert await await_until(granted), \
                "the sharded allocator never granted as the least-privileged user"
        # the periodic compaction (allocator/compaction.py): its record, and etcd's Compact call
        assert await stores["allocator"].put(b"/leasehold/compaction", b"{}")
        await stores["allocator"].compact(await stores["allocator"].revision(b"/leasehold/compaction"))
        await _refused(stores["agent"].put(b"/leasehold/compaction", b"{}"))
    finally:
        for s in (anonymous, *stores.values()):
            await s.close()


# -- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_redis(tmp_path, tls_files) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "tls-redis", admin_password=ADMIN_PW, users=[agent_acl("agent", AGENT_PW)],
                         tls=tls_files).start()
    yield server
    server.stop()


def test_agent_over_tls_to_redis_and_https_to_gateways(tls_redis, tls_files, policy_file, tmp_path):
    port = free_port()
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(AGENT_PW)
    gw = secrets.token_urlsafe(16)
    import hashlib
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
    proc = Proc(f"tls-agent-{port}", agent_command(
        redis_url=f"rediss://agent@127.0.0.1:{tls_redis.port}/0", redis_password_file=pw_file,
        redis_ca_file=tls_files.ca, policy=policy_file, region="eu", host="127.0.0.1", port=port,
        tls_cert_file=tls_files.cert, tls_key_file=tls_files.key, auth_disabled=False,
        gateway_tokens=[f"edge:{hashlib.sha256(gw.encode()).hexdigest()}"], log_level="warning"),
        tmp_path / "agent", env=env).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=str(tls_files.ca)), timeout=5) as client:
            for _ in range(200):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(base + "/v1/health/store").status_code == 200:
                        break
                time.sleep(0.05)
            health = client.get(base + "/v1/health/store")  # Redis reached over TLS with the ACL user
            assert health.status_code == 200 and health.json()["scriptsLoaded"] is True
            d = client.post(base + "/v1/admit", json=admit_body("tls-000001"),
                            headers={"Authorization": f"Bearer {gw}"}).json()
            assert d["allowed"] and not d["fallback"]
        with pytest.raises(httpx.ConnectError):  # an untrusted certificate is refused by a verifying client
            httpx.get(base + "/healthz", timeout=5)
        assert int(tls_redis.cli("DBSIZE")) > 0
    finally:
        proc.stop()


def test_leasehold_up_generates_a_pepper_and_creates_the_etcd_roles(tmp_path):
    """`leasehold up` (the CLI, auth on): the agents get a pepper generated into .run/secrets (not
    the public development pepper, which stays an explicit opt-in), etcd runs with the publisher,
    allocator and agent roles, and `leasehold policy publish` publishes with the publisher."""
    run = tmp_path / "run"
    base = ["--run-dir", str(run)]
    assert cli_main([*base, "up", "--regions", "eu", "--allocators", "1"]) == 0
    try:
        state = json.loads((run / "topology.json").read_text())
        secrets_dir = run / "secrets"
        pepper = (secrets_dir / "pepper").read_bytes().strip()
        assert len(pepper) >= 32 and oct((secrets_dir / "pepper").stat().st_mode & 0o777) == "0o600"
        assert pepper not in (AGENT_DEV_PEPPER, DEV_PEPPER.encode())
        agent = next(s for s in state["services"] if s["kind"] == "agent")
        cmdline = Path(f"/proc/{agent['pid']}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{agent['pid']}/environ").read_bytes().split(b"\0")
        assert b"--pepper-file" in cmdline and b"--insecure-dev-pepper" not in cmdline
        assert not any(e.startswith(b"LEASEHOLD_AGENT_PEPPER=") for e in environ)
        gw = {"Authorization": "Bearer " + (secrets_dir / "gateway.token").read_text().strip()}
        d = httpx.post(agent["url"] + "/v1/admit", headers=gw, timeout=10, json=admit_body("up-pepper-0001",
                                                                                          pid="U-pepper")).json()
        assert d["allowed"], d
        redis_svc = next(s for s in state["services"] if s["kind"] == "redis")
        port = int(redis_svc["url"].rsplit(":", 1)[1].split("/")[0])
        admin = redis.Redis(host="127.0.0.1", port=port, password=(secrets_dir / "redis-admin.password").read_text())
        keys = {k.decode() for k in admin.keys("rl:v3:{t:atlas}:u:*")}
        assert keys == {f"rl:v3:{{t:atlas}}:u:{KeyBuilder(pepper).h('atlas', 'u', 'U-pepper')}:read"}, keys
        assert KeyBuilder(AGENT_DEV_PEPPER).h("atlas", "u", "U-pepper") not in str(keys)
        # etcd roles: the allocator's and the agents' credentials cannot publish or write
        etcd_ep = next(s for s in state["services"] if s["kind"] == "etcd")["url"].removeprefix("http://")
        newer = tmp_path / "newer.json"
        b = load_bundle_file(str(DEFAULT_POLICY))
        newer.write_bytes(encode_bundle(seal(msgspec.structs.replace(b, bundle_version=b.bundle_version + 1))))
        for user in ("allocator", "agent"):
            assert cli_main(["policy", "publish", str(newer), "--etcd", etcd_ep, "--etcd-user", user,
                             "--etcd-password-file", str(secrets_dir / f"etcd-{user}.password")]) != 0
        assert cli_main([*base, "policy", "publish", str(newer)]) == 0  # the topology's publisher credentials
        assert cli_main([*base, "policy", "show"]) == 0
    finally:
        assert cli_main([*base, "down"]) == 0


def test_the_roles_script_names_an_unset_password_variable_and_an_etcd_that_does_not_answer(tmp_path):
    """An operator running deploy/etcd/leasehold-roles.sh by hand: an unset *_PASSWORD_FILE was the
    shell's "parameter not set", and an ETCDCTL_ENDPOINTS nobody answers kept the script waiting
    for ever (etcdctl retries `user list` without end); now exit 2 naming the variable, and exit 3
    naming the endpoints within the documented 10 s."""
    import subprocess

    files = {u: tmp_path / f"etcd-{u}.password" for u in ETCD_USERS}
    for f in files.values():
        f.write_text(secrets.token_urlsafe(16))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL_") and not k.endswith("_PASSWORD_FILE")}
    env |= {f"{u.upper()}_PASSWORD_FILE": str(f) for u, f in files.items() if u != "agent"}
    run = ["sh", str(etcd_roles_script())]
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("AGENT_PASSWORD_FILE is not set"), r.stderr
    env |= {"AGENT_PASSWORD_FILE": str(files["agent"]), "ETCDCTL_ENDPOINTS": f"127.0.0.1:{free_port()}"}
    started = time.monotonic()
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=40)
    assert r.returncode == 3 and "etcd does not answer at 127.0.0.1:" in r.stderr, r.stderr
    assert time.monotonic() - started < 15
