"""TLS between the allocator and etcd: a real etcd serving clients over TLS only, the etcd
adapter with the CA, and the allocator process granting a lease through it."""

from __future__ import annotations

import time

import httpx
import pytest

from kernel.bundle import Bundle, Pool, encode_bundle, seal
from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdStore
from kernel.etcd_tls import credentials
from leasehold.procs import LOOPBACK, EtcdCluster, Proc, free_port, make_tls, wait_port
from leasehold.services import allocator_command


@pytest.fixture
def tls_etcd(tmp_path):
    tls = make_tls(tmp_path / "tls")
    cluster = EtcdCluster(tmp_path / "etcd", members=1, tls=tls).start()
    yield cluster, tls
    cluster.stop()


async def test_etcd_adapter_speaks_tls_and_plaintext_fails(tls_etcd):
    cluster, tls = tls_etcd
    store = EtcdStore(cluster.endpoints, timeout_s=2.0, tls=credentials(str(tls.ca)))
    try:
        ok, _ = await store.txn([store.t.version(b"/tls-check") == 0], [store.t.put(b"/tls-check", b"over-tls")])
        assert ok
        kv = await store.get(b"/tls-check")
        assert kv is not None and kv.value == b"over-tls"
    finally:
        await store.close()
    plain = EtcdStore(cluster.endpoints, timeout_s=1.0)
    try:
        with pytest.raises(LeaseholdError):
            await plain.get(b"/tls-check")  # a plaintext client cannot talk to a TLS-only etcd
    finally:
        await plain.close()


def test_allocator_grants_through_a_tls_etcd(tls_etcd, tmp_path):
    cluster, tls = tls_etcd
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[],
                         pools=[Pool(id="tls-pool", window_ms=60_000, limit=100, chunk_max=10)]))
    policy = tmp_path / "bundle.json"
    policy.write_bytes(encode_bundle(bundle))
    port = free_port()
    proc = Proc("allocator-tls", allocator_command(etcd=cluster.endpoints, etcd_ca_file=tls.ca, policy=policy,
                                                   node_id="tls-1", host=LOOPBACK, port=port, auth_disabled=True,
                                                   policy_from_etcd=False), tmp_path / "alloc").start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://{LOOPBACK}:{port}"
        with httpx.Client(base_url=base, timeout=5) as client:
            for _ in range(100):  # bounded wait for leadership
                if client.get("/readyz").status_code == 200 and client.get("/v1/leader").json().get("isSelf"):
                    break
                time.sleep(0.1)
            r = client.post("/v1/leases", json={"leaseId": "eu-tls-lease-0001", "region": "eu",
                                                "pool": "tls-pool", "want": 5})
            assert r.status_code == 200, r.text
            assert r.json()["granted"] == 5
    finally:
        proc.stop()
