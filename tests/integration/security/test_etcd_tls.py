"""TLS on every etcd link, against a real etcd that serves clients over TLS only and requires a
client certificate signed by its CA (``--client-cert-auth``): the etcd adapter, the allocator
process, the agent's policy watcher (a process) and the ``leasehold`` CLI (a process). An
``https://`` endpoint is never dialled in plaintext, a client without a certificate — or with
one from another CA — is refused, and so is a CA that did not sign etcd's certificate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from kernel.bundle import Bundle, Pool, encode_bundle, load_bundle_file, seal
from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdStore, TxnBuilder
from kernel.etcd_tls import link_credentials
from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, TlsFiles, free_port, make_tls, wait_port
from leasehold.local.services import agent_command, allocator_command

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    """The etcd's CA and certificates, and a rogue CA with its own client certificate."""
    d = tmp_path_factory.mktemp("pki")
    return make_tls(d / "etcd"), make_tls(d / "rogue")


@pytest.fixture(scope="module")
def mtls_etcd(tmp_path_factory: pytest.TempPathFactory, pki) -> Iterator[EtcdCluster]:
    tls, _ = pki
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-mtls"), members=1, tls=tls, client_cert_auth=True).start()
    yield cluster
    cluster.stop()


def client_files(tls: TlsFiles) -> tuple[str, str]:
    assert tls.client_cert is not None and tls.client_key is not None
    return str(tls.client_cert), str(tls.client_key)


async def test_adapter_with_ca_and_client_certificate(mtls_etcd: EtcdCluster, pki):
    tls, rogue = pki
    cert, key = client_files(tls)
    store = EtcdStore(mtls_etcd.urls, timeout_s=3.0, tls=link_credentials(mtls_etcd.urls, str(tls.ca), cert, key))
    try:
        txn = TxnBuilder()
        txn.absent(b"/tls-check")
        txn.put(b"/tls-check", b"over-tls")
        assert (await store.commit(txn)).succeeded
        kv = await store.get(b"/tls-check")
        assert kv is not None and kv.value == b"over-tls"
    finally:
        await store.close()
    refused = {
        "no client certificate": link_credentials(mtls_etcd.urls, str(tls.ca)),
        "a client certificate of another CA": link_credentials(mtls_etcd.urls, str(tls.ca), *client_files(rogue)),
        "a CA that did not sign etcd's certificate": link_credentials(mtls_etcd.urls, str(rogue.ca), cert, key),
        "https:// without a CA (public roots)": link_credentials(mtls_etcd.urls),
        "plaintext": None,
    }
    for why, creds in refused.items():
        endpoints = mtls_etcd.endpoints if creds is None else mtls_etcd.urls
        other = EtcdStore(endpoints, timeout_s=1.0, tls=creds)
        try:
            with pytest.raises(LeaseholdError):
                await other.get(b"/tls-check")
        finally:
            await other.close()
        assert why


def test_allocator_grants_through_an_mtls_etcd(mtls_etcd: EtcdCluster, pki, tmp_path: Path):
    tls, _ = pki
    cert, key = client_files(tls)
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[],
                         pools=[Pool(id="tls-pool", window_ms=60_000, limit=100, chunk_max=10)]))
    policy = tmp_path / "bundle.json"
    policy.write_bytes(encode_bundle(bundle))
    port = free_port()
    proc = Proc("allocator-tls", allocator_command(
        etcd=",".join(mtls_etcd.urls), etcd_ca_file=tls.ca, etcd_cert_file=cert, etcd_key_file=key, policy=policy,
        node_id="tls-1", host=LOOPBACK, port=port, auth_disabled=True, policy_from_etcd=False,
        prefix="/alloc-tls/"), tmp_path / "alloc").start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://{LOOPBACK}:{port}"
        with httpx.Client(base_url=base, timeout=5) as client:
            for _ in range(200):  # bounded wait for leadership
                if client.get("/readyz").status_code == 200 and client.get("/v1/leader").json().get("isSelf"):
                    break
                time.sleep(0.1)
            r = client.post("/v1/leases", json={"leaseId": "eu-tls-lease-0001", "region": "eu",
                                                "pool": "tls-pool", "want": 5})
            assert r.status_code == 200, r.text + proc.tail()
            assert r.json()["granted"] == 5
    finally:
        proc.stop()
    # the grant is in etcd (read over TLS with etcdctl's client certificate)
    assert "eu-tls-lease-0001" in mtls_etcd.etcdctl("get", "--prefix", "--keys-only", "/alloc-tls/grants/")


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("leasehold")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leasehold.commands.cli"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    return subprocess.run([*cmd, *argv], env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True,
                          text=True, timeout=60)


def test_cli_and_agent_follow_policy_over_mtls(mtls_etcd: EtcdCluster, pki, tmp_path: Path, redis_url: str):
    """The CLI publishes over TLS (flags, then the environment), an agent process follows the key
    over TLS with its client certificate; without a certificate the CLI cannot connect (exit 5)."""
    tls, _ = pki
    cert, key = client_files(tls)
    prefix = "/policy-tls/"
    start = load_bundle_file(str(ROOT / "policies" / "northstar.json"))
    v43 = tmp_path / "v43.json"
    v43.write_bytes(encode_bundle(seal(msgspec.structs.replace(start, bundle_version=43))))
    v44 = tmp_path / "v44.json"
    v44.write_bytes(encode_bundle(seal(msgspec.structs.replace(start, bundle_version=44))))
    etcd = ",".join(mtls_etcd.urls)

    res = cli("policy", "publish", str(v43), "--etcd", etcd, "--prefix", prefix, "--etcd-ca-file", str(tls.ca),
              "-o", "json")
    assert res.returncode == 5, res.stderr  # no client certificate: etcd refuses the handshake
    assert json.loads(res.stdout)["error"]["kind"] == "connect" and "Traceback" not in res.stderr

    res = cli("policy", "publish", str(v43), "--etcd", etcd, "--prefix", prefix, "--etcd-ca-file", str(tls.ca),
              "--etcd-cert-file", cert, "--etcd-key-file", key, "-o", "json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["published"] == 43

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    agent = Proc("agent-tls", agent_command(
        redis_url=redis_url, policy=ROOT / "policies" / "northstar.json", region="eu", host=LOOPBACK, port=port,
        policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=True, lease_warmup=False,
        policy_etcd=etcd, policy_etcd_prefix=prefix, policy_etcd_reread_ms=200, policy_etcd_ca_file=tls.ca,
        policy_etcd_cert_file=cert, policy_etcd_key_file=key), tmp_path / "agent", env=env).start()
    try:
        wait_port(port, proc=agent.popen, timeout=30)

        def version() -> int | None:
            try:
                return httpx.get(f"http://{LOOPBACK}:{port}/v1/policy", timeout=2).json()["bundleVersion"]
            except (httpx.HTTPError, KeyError, ValueError):
                return None

        for _ in range(300):  # bounded wait: the watcher's first read
            if version() == 43:
                break
            time.sleep(0.1)
        assert version() == 43, agent.tail()
        tls_env = {"LEASEHOLD_ETCD": etcd, "LEASEHOLD_ETCD_PREFIX": prefix, "LEASEHOLD_ETCD_CA_FILE": str(tls.ca),
                   "LEASEHOLD_ETCD_CERT_FILE": cert, "LEASEHOLD_ETCD_KEY_FILE": key}
        res = cli("policy", "publish", str(v44), env=tls_env)
        assert res.returncode == 0, res.stderr
        for _ in range(300):
            if version() == 44:
                break
            time.sleep(0.1)
        assert version() == 44, agent.tail()
        shown = cli("policy", "show", "-o", "json", env=tls_env)
        assert shown.returncode == 0 and json.loads(shown.stdout)["bundleVersion"] == 44
    finally:
        agent.stop()


def test_a_cli_refused_by_etcds_tls_says_so_in_one_line(mtls_etcd: EtcdCluster, pki):
    """A wrong CA: the CLI's own line and exit code, nothing else on stderr (grpc's core logged the
    handshake failure first, and the etcd adapter's per-endpoint lines reached stderr through
    logging's last resort: four lines for one refusal)."""
    _, rogue = pki
    res = cli("policy", "show", "--etcd", ",".join(mtls_etcd.urls), "--etcd-ca-file", str(rogue.ca))
    assert res.returncode == 5 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("leasehold: cannot read") and "TLS handshake" in lines[0], lines
