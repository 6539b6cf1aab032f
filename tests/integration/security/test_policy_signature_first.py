"""Someone who can write the policy key in etcd (an etcd credential, not the signing key) against an
agent that trusts only signed bundles (``--policy-public-keys``), on a real etcd, a real Redis and the
agent as a process (``python -m region_agent``), docs/decisions/0079.

The agent validated every value it read before it looked at its signature: a bundle naming a few
hundred tenants and route groups (``tests.support.policies.expensive_bundle``: about a second of the
request-set check) cost it that second on its event loop, per value written, and was counted
``invalid`` (that check refuses it too). It now verifies first: each such value is counted by its
signature outcome (``unsigned``, ``untrusted_key``), the ``invalid`` count stays at 0 (the validation,
which would find it invalid, never ran), and decisions keep being answered from the bundle in force."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kernel.bundle import encode_bundle, seal
from kernel.etcd_store import EtcdStore
from kernel.policy_store import policy_key
from kernel.signing import generate_keypair, load_private_key, sign_bundle
from leasehold.commands.cli import main as cli_main
from tests.support.agent import admit_body, agent_process
from tests.support.policies import expensive_bundle, northstar
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


def reloads(url: str) -> dict[str, float]:
    # a long timeout: while the agent validates a bundle a trusted key signed (expensive_bundle: about a
    # second of its event loop on a quiet machine, several beside busy cores) it answers nothing
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("leasehold_agent_policy_reloads_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def put(endpoints: str, prefix: str, raw: bytes) -> None:
    """Write the policy key straight to etcd (no publish, no signing marker: what a leaked etcd credential does)."""
    async def go() -> None:
        store = EtcdStore(endpoints)
        try:
            await store.put(policy_key(prefix), raw)
        finally:
            await store.close()
    asyncio.run(go())


def test_bundles_no_trusted_key_signed_are_refused_by_their_signature_never_validated(
        etcd_cluster, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    key_path, pub = generate_keypair(tmp_path / "keys")
    key = load_private_key(key_path)
    start = northstar()
    policy = tmp_path / "bundle.json"
    policy.write_bytes(encode_bundle(sign_bundle(start, key)))
    endpoints, prefix = ",".join(etcd_cluster.endpoints), f"/lh-{uuid.uuid4().hex[:8]}/"
    rogue = Ed25519PrivateKey.generate()
    forgeries = [("unsigned", encode_bundle(expensive_bundle(50))),
                 ("untrusted_key", encode_bundle(sign_bundle(expensive_bundle(51), rogue))),
                 ("unsigned", encode_bundle(expensive_bundle(52))),
                 ("untrusted_key", encode_bundle(sign_bundle(expensive_bundle(53), rogue)))]
    with agent_process(tmp_path, redis_url, policy, "--policy-public-keys", str(pub), "--policy-etcd", endpoints,
                       "--policy-etcd-prefix", prefix, "--policy-etcd-reread-ms", "200") as (url, proc):
        assert reloads(url)["invalid"] == 0
        for i, (outcome, raw) in enumerate(forgeries):
            before = reloads(url)
            put(endpoints, prefix, raw)
            assert wait_until(lambda o=outcome, b=before: reloads(url)[o] == b[o] + 1), (outcome, proc.tail())
            d = httpx.post(url + "/v1/admit", json=admit_body(f"sigfirst-{i:08d}"), timeout=5).json()
            assert d["allowed"] and d["policyVersion"] == start.bundle_version, d  # the bundle in force answers
        counts = reloads(url)
        # every one refused for its signature alone: the validation (which refuses each as invalid) never ran
        assert (counts["unsigned"], counts["untrusted_key"], counts["invalid"]) == (2, 2, 0), counts
        log = proc.log_path.read_text() if proc.log_path else ""
        assert "policy reload refused (unsigned): bundle 50 is unsigned and signatures are required" in log, log
        assert "script slots" not in log, log
        # policy show: without a signing marker it validates (INVALID); with one it verifies first, as the agent
        capsys.readouterr()
        assert cli_main(["policy", "show", "--etcd", endpoints, "--prefix", prefix]) == 2  # refused: not a success
        assert "INVALID: policy bundle 53 is invalid: " in capsys.readouterr().out
        assert cli_main(["policy", "require-signed", "--etcd", endpoints, "--prefix", prefix,
                         "--public-keys", str(pub)]) == 0
        capsys.readouterr()
        assert cli_main(["policy", "show", "--etcd", endpoints, "--prefix", prefix, "-o", "json"]) == 2
        shown = json.loads(capsys.readouterr().out)
        assert (shown["valid"], shown["refused"]) == (False, "untrusted_key") and "not trusted" in shown["problem"]
        assert cli_main(["policy", "show", "--etcd", endpoints, "--prefix", prefix]) == 2
        assert "REFUSED (untrusted_key): bundle 53 is signed by key " in capsys.readouterr().out
        # the same bytes signed by the trusted key are checked in full: invalid (the request-set check)
        before = reloads(url)
        put(endpoints, prefix, encode_bundle(sign_bundle(expensive_bundle(54), key)))
        assert wait_until(lambda: reloads(url)["invalid"] == before["invalid"] + 1, within_s=60), proc.tail()
        # and a valid signed bundle is still followed
        newer = seal(msgspec.structs.replace(start, bundle_version=start.bundle_version + 100))
        put(endpoints, prefix, encode_bundle(sign_bundle(newer, key)))
        assert wait_until(lambda: httpx.get(url + "/v1/policy", timeout=5).json()["bundleVersion"]
                          == start.bundle_version + 100), proc.tail()

