"""Reading the allocator's records back from a real etcd, and judging them with the checker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid

import msgspec
import pytest

from allocator.allocation import WindowState
from allocator.records import GrantRecord, LeaderRecord
from chaos.checker import check
from chaos.etcd_records import RecordKeeper, read_back
from chaos.history import EtcdGrant, EtcdWindow, HistoryError, Leader, grant_from_wire
from kernel.bundle import Pool
from kernel.wire import LeaseGrant, WindowRef
from leasehold.local.procs import EtcdCluster

pytestmark = pytest.mark.integration
POOL = Pool(id="p-global", window_ms=10_000, limit=100, chunk_max=60)


def etcdctl(cluster: EtcdCluster, *args: str) -> None:
    subprocess.run(["etcdctl", "--endpoints", ",".join(cluster.endpoints), *args],
                   check=True, capture_output=True, timeout=20, env={**os.environ, "ETCDCTL_API": "3"})


def put(cluster: EtcdCluster, key: str, value: bytes) -> None:
    etcdctl(cluster, "put", key, value.decode())


def lease(lease_id: str, granted: int, epoch: int, region: str = "eu") -> LeaseGrant:
    return LeaseGrant(lease_id=lease_id, pool="p-global", region=region, granted=granted,
                      window=WindowRef(index=7, start_ms=70_000, end_ms=80_000), expires_at_ms=75_000,
                      ttl_ms=5_000, starts_in_ms=0, epoch=epoch, issued_at_ms=70_000, remaining=0)


async def test_grants_windows_and_leader_are_read_back_and_checked(etcd_cluster: EtcdCluster):
    prefix = f"/chaos-{uuid.uuid4().hex[:8]}/"
    put(etcd_cluster, prefix + "leader", msgspec.json.encode(LeaderRecord(node_id="alloc-1", url="http://x")))
    [leader] = [r for r in await read_back(etcd_cluster.endpoints, prefix) if isinstance(r, Leader)]
    epoch = leader.epoch  # the election key's create_revision, as the allocator stamps it
    a, b = lease("lease-eu-0001", 60, epoch=epoch), lease("lease-us-0001", 60, epoch=epoch, region="us")
    put(etcd_cluster, prefix + "grants/lease-eu-0001",
        msgspec.json.encode(GrantRecord(grant=a, reported=True, spent=50, returned=10)))
    put(etcd_cluster, prefix + "grants/lease-us-0001", msgspec.json.encode(GrantRecord(grant=b)))
    state = WindowState(pool="p-global", index=7, limit=100, remaining=-10, granted={"eu": 60, "us": 60},
                        returned={"eu": 10})
    put(etcd_cluster, prefix + "pools/p-global/7", msgspec.json.encode(state))

    recs = await read_back(etcd_cluster.endpoints, prefix)
    grants = {r.lease_id: r for r in recs if isinstance(r, EtcdGrant)}
    assert grants["lease-eu-0001"].spent == 50 and grants["lease-eu-0001"].returned == 10
    assert grants["lease-us-0001"].spent is None and grants["lease-us-0001"].create_revision
    [window] = [r for r in recs if isinstance(r, EtcdWindow)]
    assert (window.granted, window.returned, window.remaining) == (120, 10, -10)
    [leader] = [r for r in recs if isinstance(r, Leader)]
    assert leader.node == "alloc-1" and leader.epoch == epoch < grants["lease-eu-0001"].create_revision

    received = [grant_from_wire(a, sent_at_ms=70_000, received_at_ms=70_005),
                grant_from_wire(b, sent_at_ms=70_000, received_at_ms=70_005)]
    report = check(received + recs, [POOL])
    bad = {v.invariant for v in report.verdicts if not v.ok}
    # 60 + 60 - 10 = 110 > 100, both in the grant records and in etcd's window record
    assert bad == {"granted_within_limit", "window_states_within_limit"}, report.render()

    # a grant stamped with the old epoch committed after a newer leader was elected: fenced out
    etcdctl(etcd_cluster, "del", prefix + "leader")  # the old leader's key is gone; a new one is created
    put(etcd_cluster, prefix + "leader", msgspec.json.encode(LeaderRecord(node_id="alloc-2", url="http://y")))
    put(etcd_cluster, prefix + "grants/lease-eu-0002", msgspec.json.encode(GrantRecord(grant=lease(
        "lease-eu-0002", 0, epoch=epoch))))
    recs = await read_back(etcd_cluster.endpoints, prefix)
    report = check(recs, [POOL])
    assert [v.lease_id for v in report.verdict("no_stale_epoch_commit").violations] == ["lease-eu-0002"]


async def test_unreadable_record_is_a_clear_error(etcd_cluster: EtcdCluster):
    prefix = f"/chaos-{uuid.uuid4().hex[:8]}/"
    put(etcd_cluster, prefix + "grants/lease-bad-0001", b'{"grant": 1}')
    with pytest.raises(HistoryError, match="lease-bad-0001"):
        await read_back(etcd_cluster.endpoints, prefix)


async def test_records_expired_before_the_final_read_are_kept(etcd_cluster: EtcdCluster):
    """A run longer than the records' linger: what the keeper read during it still reaches the
    checker, each record once, in the final read's version where it still exists."""
    prefix = f"/chaos-{uuid.uuid4().hex[:8]}/"
    put(etcd_cluster, prefix + "leader", msgspec.json.encode(LeaderRecord(node_id="alloc-1", url="http://x")))
    a, b = lease("lease-eu-0001", 60, epoch=1), lease("lease-us-0001", 30, epoch=1, region="us")
    put(etcd_cluster, prefix + "grants/lease-eu-0001", msgspec.json.encode(GrantRecord(grant=a)))
    put(etcd_cluster, prefix + "grants/lease-us-0001", msgspec.json.encode(GrantRecord(grant=b)))
    state = WindowState(pool="p-global", index=7, limit=100, remaining=10, granted={"eu": 60, "us": 30})
    put(etcd_cluster, prefix + "pools/p-global/7", msgspec.json.encode(state))
    keeper = RecordKeeper(etcd_cluster.endpoints, prefix)
    await keeper.read_once()
    assert keeper.reads == 1 and len(keeper.seen) == 3

    etcdctl(etcd_cluster, "del", prefix + "grants/lease-eu-0001")  # expired with its etcd lease
    etcdctl(etcd_cluster, "del", prefix + "pools/p-global/7")
    put(etcd_cluster, prefix + "grants/lease-us-0001",  # reported since the keeper read it
        msgspec.json.encode(GrantRecord(grant=b, reported=True, spent=20, returned=10)))

    without = await read_back(etcd_cluster.endpoints, prefix)
    assert [r.lease_id for r in without if isinstance(r, EtcdGrant)] == ["lease-us-0001"]
    recs = await read_back(etcd_cluster.endpoints, prefix, kept=keeper)
    grants = sorted((r for r in recs if isinstance(r, EtcdGrant)), key=lambda r: r.lease_id)
    assert [(g.lease_id, g.spent, g.returned) for g in grants] == [("lease-eu-0001", None, 0),
                                                                 ("lease-us-0001", 20, 10)]
    [window] = [r for r in recs if isinstance(r, EtcdWindow)]
    assert (window.pool, window.window_index, window.granted) == ("p-global", 7, 90)

    received = [grant_from_wire(a, sent_at_ms=70_000, received_at_ms=70_005)]
    bad = {v.invariant for v in check(received + without, [POOL]).verdicts if not v.ok}
    assert "acknowledged_grants_persisted" in bad  # what a long run reported before the keeper
    bad = {v.invariant for v in check(received + recs, [POOL]).verdicts if not v.ok}
    assert "acknowledged_grants_persisted" not in bad


async def test_the_keeper_stops_at_once_and_survives_an_unreachable_etcd():
    stop = asyncio.Event()
    keeper = RecordKeeper("http://127.0.0.1:9", "/x/", every_s=0.05, timeout_s=0.2)
    task = asyncio.create_task(keeper.run(stop))
    await asyncio.sleep(0.5)
    assert not task.done() and keeper.reads == 0  # failed reads are skipped, the keeper goes on
    stop.set()
    await asyncio.wait_for(task, 5)
