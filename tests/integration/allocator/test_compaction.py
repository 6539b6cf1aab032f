"""etcd compaction by the allocator (allocator/compaction.py) on a real etcd: the leader compacts
history to the revision it saw one interval before, fenced by its epoch; a follower does not;
grants, usage reports, lease reads and the policy watch keep working across compactions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec

from allocator.compaction import CompactionRecord
from kernel.bundle import Bundle, Pool, encode_bundle, seal
from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import in_process, lease_body, settings_for, unique_prefix
from tests.support.waiting import await_until

from .conftest import TestClock, W


def read_at(etcd: EtcdCluster, key: bytes, revision: int) -> str:
    r = subprocess.run(["etcdctl", "--endpoints", ",".join(etcd.endpoints), "get", key.decode(), f"--rev={revision}",
                        "--print-value-only"], capture_output=True, text=True, timeout=15,
                       env={**os.environ, "ETCDCTL_API": "3"})
    return r.stdout.strip() if r.returncode == 0 else r.stderr


async def test_the_leader_compacts_etcd_and_the_service_keeps_working(tmp_path: Path, make_bundle,
                                                                       clock: TestClock) -> None:
    etcd = EtcdCluster(tmp_path / "etcd", members=1).start()  # compaction is cluster-wide: a private etcd
    pool = Pool(id="cp", window_ms=W, limit=100_000, lease_ttl_ms=2_000, chunk_max=100)
    bundle = make_bundle(pool)
    prefix = unique_prefix()
    reader = EtcdStore(",".join(etcd.endpoints), timeout_s=5)
    key = f"{prefix}compaction".encode()
    try:
        t0 = clock.place_in_window(W, 1_000, freeze=True)
        leader_settings = settings_for(etcd, bundle, prefix, etcd_compaction_interval_s=1, policy_reread_ms=600_000)
        follower_settings = settings_for(etcd, bundle, prefix, node_id="n2", etcd_compaction_interval_s=1)
        async with in_process(leader_settings, clock=clock) as client:
            first = (await client.post("/v1/leases", json=lease_body("compact-0001", "cp", "eu", 10))).json()
            async with _follower(follower_settings, clock):
                for i in range(2, 40):
                    r = await client.post("/v1/leases", json=lease_body(f"compact-{i:04d}", "cp", "eu", 10))
                    assert r.status_code == 200
                old_rev = (await reader.get(f"{prefix}pools/cp/{first['window']['index']}".encode())).mod_revision
                assert await await_until(lambda: _compacted_past(reader, key, old_rev), within_s=20), \
                    "no compaction past the old revision recorded"
            rec = msgspec.json.decode((await reader.get(key)).value, type=CompactionRecord)
            assert rec.node_id == "n1" and rec.revision > old_rev  # the leader, never the follower
            assert "required revision has been compacted" in read_at(etcd, key, rec.revision - 1)
            # everything still works after the compaction: grants, replays, lease reads, usage reports
            again = await client.post("/v1/leases", json=lease_body("compact-0001", "cp", "eu", 10))
            assert again.json()["replayed"] is True and again.json()["granted"] == 10
            new = await client.post("/v1/leases", json=lease_body("compact-0100", "cp", "eu", 10))
            assert new.status_code == 200 and new.json()["remaining"] == 100_000 - 40 * 10
            assert (await client.get("/v1/leases/compact-0002?region=eu")).json()["grant"]["granted"] == 10
            clock.frozen = t0 + 2_000
            rep = await client.post("/v1/usage/batch", json={"reports": [
                {"leaseId": "compact-0002", "pool": "cp", "region": "eu", "spent": 4}]})
            assert rep.json()["results"][0]["returned"] == 6
            # the policy watch was opened before the compactions: a bundle published now still arrives
            bundle2 = seal(Bundle(bundle_version=2, published_at="2026-11-29T00:00:01Z", checksum="", rules=[],
                                  pools=[pool, Pool(id="cp2", window_ms=W, limit=500)]))
            await PolicyStore(reader, prefix).publish(encode_bundle(bundle2))
            assert await await_until(lambda: "cp2" in client.app_state.writer.pools, within_s=10), \
                "the bundle published after the compactions did not arrive"
            text = (await client.get("/metrics")).text
        assert "leasehold_allocator_etcd_compactions_total" in text
        assert float(text.split("\nleasehold_allocator_etcd_compacted_revision ")[1].split()[0]) >= rec.revision
    finally:
        await reader.close()
        etcd.stop()


async def _compacted_past(reader: EtcdStore, key: bytes, revision: int) -> bool:
    kv = await reader.get(key)
    return kv is not None and msgspec.json.decode(kv.value, type=CompactionRecord).revision > revision


def _follower(settings, clock):
    """A second replica in this event loop that never leads (the first one does)."""
    from contextlib import asynccontextmanager

    from litestar.testing import AsyncTestClient

    from allocator.app import create_app

    @asynccontextmanager
    async def run():
        app = create_app(settings, clock=clock)
        async with AsyncTestClient(app=app, timeout=30):
            assert await await_until(lambda: app.state.election.role_known), \
                "the follower never learned its role"
            assert not app.state.election.is_leader
            yield app
    return run()
