"""Signed policy bundles on real processes: a signed ``leasehold up``-style topology
(etcd, an allocator, Redis and an agent following the etcd key), forged bundles written straight
into etcd and into the bundle file, and a key rotation with two trusted keys.

Every forgery — tampered after signing, signed by an untrusted key, unsigned — is refused by the
agent and by the allocator, each refusal is counted by outcome, and the previous bundle keeps
serving decisions and grants."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kernel.bundle import Bundle, compute_checksum, encode_bundle, load_bundle_file, seal
from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore
from kernel.signing import generate_keypair, load_private_key, sign_bundle
from leasehold.commands.cli import EXIT_BYPASS, EXIT_OK, EXIT_USAGE
from leasehold.commands.cli import main as cli_main
from leasehold.local.procs import LOOPBACK, Proc, free_port, wait_port
from leasehold.local.services import agent_command, allocator_command
from leasehold.local.topology import DEFAULT_POLICY, LocalTopology, TopologySpec
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
BASE = load_bundle_file(str(DEFAULT_POLICY))


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} " if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def version(b: Bundle, v: int, **changes) -> Bundle:
    return seal(msgspec.structs.replace(b, bundle_version=v, **changes))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("keys")
    return {name: generate_keypair(d, name) for name in ("next", "rogue")}


@pytest.fixture(scope="module")
def topo(tmp_path_factory, keys) -> Iterator[LocalTopology]:
    spec = TopologySpec(run_dir=tmp_path_factory.mktemp("signed"), regions=("eu",), allocators=1,
                        policy_from_etcd=True, signed=True, extra_public_keys=(str(keys["next"][1]),),
                        agent_args=("--policy-etcd-reread-ms", "200", "--policy-poll-ms", "200"),
                        allocator_args=("--policy-reread-ms", "200"))
    t = LocalTopology(spec).start()
    yield t
    t.stop()


def etcd_put(topo: LocalTopology, raw: bytes) -> None:
    """Write a value to the policy key directly (what someone with etcd write access could do)."""
    async def put() -> None:
        store = PolicyStore(EtcdStore(",".join(topo.etcd.endpoints)), "/leasehold/")
        try:
            await store.store.put(store.key, raw)
        finally:
            await store.store.close()
    asyncio.run(put())


def in_force(topo: LocalTopology) -> tuple[int, int, int]:
    """(agent's /v1/policy, a decision's policyVersion, allocator's policy version gauge)."""
    agent, alloc = topo.agent_urls["eu"][0], topo.allocator_urls[0]
    shown = httpx.get(agent + "/v1/policy", timeout=5).json()["bundleVersion"]
    d = httpx.post(agent + "/v1/admit", timeout=5, json={
        "requestId": f"signed-{time.monotonic_ns()}", "tenantId": "birch",
        "principal": {"type": "user", "id": "B-1"}, "routeGroup": "read"}).json()
    return shown, d["policyVersion"], int(metric(alloc, "leasehold_allocator_policy_version"))


def publish(topo: LocalTopology, path: Path, *extra: str) -> int:
    return cli_main(["--run-dir", str(topo.spec.run_dir), "policy", "publish", str(path), *extra])


def test_started_signed_and_publish_signs_or_refuses(topo: LocalTopology, keys, tmp_path: Path):
    agent, alloc = topo.agent_urls["eu"][0], topo.allocator_urls[0]
    start = load_bundle_file(str(topo.policy_path))
    assert start.key_id and start.signature  # leasehold up signed its start bundle
    assert in_force(topo) == (42, 42, 42)
    ep = ",".join(topo.etcd.endpoints)
    v43 = tmp_path / "v43.json"
    v43.write_bytes(encode_bundle(version(BASE, 43)))
    # the etcd signing marker: an unsigned bundle, or one signed by an unknown key, is refused at publish time
    assert cli_main(["policy", "publish", str(v43), "--etcd", ep]) == EXIT_USAGE
    assert cli_main(["policy", "publish", str(v43), "--etcd", ep, "--key", str(keys["rogue"][0])]) == EXIT_USAGE
    # against the running topology the CLI signs with its generated key
    assert publish(topo, v43) == EXIT_OK
    assert wait_until(lambda: in_force(topo) == (43, 43, 43)), (in_force(topo), topo.agents["eu"][0].tail())
    assert metric(agent, "leasehold_agent_policy_reloads_total", outcome="accepted") >= 1
    assert metric(alloc, "leasehold_allocator_policy_reloads_total", outcome="accepted") >= 1


def test_forged_bundles_in_etcd_are_refused_counted_and_the_previous_keeps_serving(topo: LocalTopology, keys):
    agent, alloc = topo.agent_urls["eu"][0], topo.allocator_urls[0]
    assert wait_until(lambda: in_force(topo)[0] >= 43)
    current = in_force(topo)
    topo_key = load_private_key(topo.signing[0])
    signed = sign_bundle(version(BASE, 60), topo_key)
    rules = [msgspec.structs.replace(r, limit=1_000_000) if r.exempt else r for r in signed.rules]
    tampered = msgspec.structs.replace(signed, rules=rules,  # a bypass widened after signing
                                       checksum=compute_checksum(rules, signed.pools, signed.max_age_ms))
    forgeries = {
        "bad_signature": tampered,
        "untrusted_key": sign_bundle(version(BASE, 61), load_private_key(keys["rogue"][0])),
        "unsigned": version(BASE, 62),
    }
    for outcome, bundle in forgeries.items():
        before = (metric(agent, "leasehold_agent_policy_reloads_total", outcome=outcome),
                  metric(alloc, "leasehold_allocator_policy_reloads_total", outcome=outcome))
        etcd_put(topo, encode_bundle(bundle))
        assert wait_until(lambda o=outcome, b=before: (
            metric(agent, "leasehold_agent_policy_reloads_total", outcome=o) == b[0] + 1
            and metric(alloc, "leasehold_allocator_policy_reloads_total", outcome=o) == b[1] + 1)), outcome
        assert in_force(topo) == current, outcome  # the previous bundle keeps serving
    # a forged bundle file on the agent's disk (SIGHUP / mtime reload) is refused the same way
    before = metric(agent, "leasehold_agent_policy_reloads_total", outcome="bad_signature")
    topo.policy_path.write_bytes(encode_bundle(msgspec.structs.replace(tampered, bundle_version=70)))
    assert wait_until(lambda: metric(agent, "leasehold_agent_policy_reloads_total",
                                     outcome="bad_signature") == before + 1)
    assert in_force(topo) == current
    # the allocator still grants from the pools in force
    grant = httpx.post(alloc + "/v1/leases", timeout=5, json={
        "leaseId": "eu-signed-0000001", "region": "eu", "pool": "birch-minute", "want": 5}).json()
    assert grant["granted"] >= 1


def test_rotation_with_two_trusted_keys(topo: LocalTopology, keys, tmp_path: Path):
    """Step by step as in the README: both keys trusted -> the marker lists both -> publish with the new
    key -> services that trust only the new key refuse the old one."""
    agent = topo.agent_urls["eu"][0]
    ep = ",".join(topo.etcd.endpoints)
    old_pub, new_key, new_pub = topo.signing[1], keys["next"][0], keys["next"][1]
    assert cli_main(["policy", "require-signed", "--etcd", ep, "--public-keys", f"{old_pub},{new_pub}"]) == EXIT_OK
    v80 = tmp_path / "v80.json"
    v80.write_bytes(encode_bundle(version(BASE, 80)))
    # 80 skips versions: made over the bundle in force (the forged values in etcd since are no bundle of the fleet)
    held = str(in_force(topo)[0])
    assert cli_main(["policy", "publish", str(v80), "--etcd", ep, "--key", str(new_key), "--over", held]) == EXIT_OK
    assert wait_until(lambda: in_force(topo) == (80, 80, 80)), in_force(topo)
    # a bypass widened: flagged against what etcd holds (exit 7) before it is published
    wider = tmp_path / "v81.json"
    wider.write_bytes(encode_bundle(version(BASE, 81, rules=[
        msgspec.structs.replace(r, limit=6_000) if r.exempt else r for r in BASE.rules])))
    assert cli_main(["policy", "validate", str(wider), "--against-etcd", "--etcd", ep]) == EXIT_BYPASS
    # the end of the rotation: a service trusting only the new key (started from a bundle it signed)
    start = tmp_path / "start.json"
    start.write_bytes(encode_bundle(sign_bundle(version(BASE, 80), load_private_key(new_key))))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["LEASEHOLD_AGENT_PEPPER"] = "rotation-test-pepper"
    def args_with(policy: Path) -> list[str]:
        return agent_command(redis_url=topo.redis["eu"].url, policy=policy, region="eu", host=LOOPBACK, port=port,
                             auth_disabled=True, policy_etcd=ep, policy_etcd_reread_ms=200, policy_public_keys=[new_pub])

    args = args_with(start)
    # ... refuses to start from a bundle signed by the retired key
    old_signed = tmp_path / "old-signed.json"
    old_signed.write_bytes(encode_bundle(sign_bundle(version(BASE, 80), load_private_key(topo.signing[0]))))
    bad = args_with(old_signed)
    r = subprocess.run(bad, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not trusted" in r.stderr, r.stderr
    new_only = Proc("agent-new-key", args, tmp_path / "agent-new", env=env).start()
    try:
        wait_port(port, proc=new_only.popen, timeout=30)
        url = f"http://{LOOPBACK}:{port}"
        assert wait_until(lambda: httpx.get(url + "/v1/policy", timeout=5).json()["bundleVersion"] == 80)
        # a bundle still signed by the old key: the topology's agent (both keys) takes it, the new-only one refuses
        etcd_put(topo, encode_bundle(sign_bundle(version(BASE, 90), load_private_key(topo.signing[0]))))
        assert wait_until(lambda: metric(url, "leasehold_agent_policy_reloads_total", outcome="untrusted_key") == 1)
        assert wait_until(lambda: httpx.get(agent + "/v1/policy", timeout=5).json()["bundleVersion"] == 90)
        assert httpx.get(url + "/v1/policy", timeout=5).json()["bundleVersion"] == 80
    finally:
        new_only.stop()


def test_allocator_refuses_to_start_from_an_unsigned_bundle(topo: LocalTopology, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_ALLOCATOR_")}
    r = subprocess.run(allocator_command(etcd=topo.etcd.endpoints, policy=DEFAULT_POLICY, node_id="alloc-x",
                                         port=free_port(), auth_disabled=True, policy_public_keys=[topo.signing[1]]),
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unsigned" in r.stderr, r.stderr
