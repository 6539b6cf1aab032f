"""etcd members that stop answering for a few seconds (SIGSTOP: a stalled disk, a GC pause, a hung
host), under two ``python -m allocator`` replicas run with the default ``--etcd-timeout-ms``
(2000) and ``--election-ttl-s`` (3). The raft leader is moved to the last member; the first two
(followers) are paused in turn, each the member the leader talks to at that moment (its first
endpoint, then the one it moved on to).

The leader's keepalive of its etcd lease waited the whole 2 s call bound on the stalled member
before trying the next one; its lease lives 3 s from the last keepalive etcd took, and keepalives
go out every second, so depending on when the stall began the keepalive reached the next member
after the lease had expired: the leader stepped down and the other replica took over — a
failover (LeaseholdAllocatorFailover, agents' grants refused while it settled) for one slow
follower of a healthy cluster. Now the keepalive and the election's snapshot read give each
endpoint at most a quarter of the TTL (``allocator.session``)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Pool
from leasehold.local.procs import EtcdCluster
from tests.support.allocator_app import lease_body, unique_prefix
from tests.support.policies import write_pools
from tests.support.waiting import wait_until

from .support import AllocatorProcess

PAUSE_S = 3.0


@pytest.fixture
def replicas(tmp_path: Path, fresh_etcd_cluster: EtcdCluster) -> Iterator[list[AllocatorProcess]]:
    bundle = write_pools(tmp_path / "pools.json", [Pool(id="p1", window_ms=60_000, limit=100_000, chunk_max=10)])
    prefix = unique_prefix()
    defaults = {"etcd_timeout_ms": 2000}  # what an operator runs (the helper's 1000 is a test's)
    procs = [AllocatorProcess(tmp_path, fresh_etcd_cluster, bundle, prefix, f"node{i}", election_ttl_s=3,
                              settings=defaults) for i in range(2)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def _leader(procs: list[AllocatorProcess]) -> tuple[AllocatorProcess, int] | None:
    for p in procs:
        info = p.leader_info()
        if info and info["isSelf"]:
            return p, info["epoch"]
    return None


def _raft_leadership_to_the_last_member(cluster: EtcdCluster) -> None:
    """The members paused are followers (a paused raft leader is another test: a raft election)."""
    status = json.loads(cluster.etcdctl("endpoint", "status", "-w", "json"))
    ids = [s["Status"]["header"]["member_id"] for s in status]
    if status[0]["Status"]["leader"] != ids[-1]:
        cluster.etcdctl("move-leader", format(ids[-1], "x"))
    assert wait_until(lambda: json.loads(cluster.etcdctl("endpoint", "status", "-w", "json"))[0]["Status"]["leader"]
                      == ids[-1], 10)


def test_one_stalled_etcd_member_does_not_move_the_allocator_leadership(
        replicas: list[AllocatorProcess], fresh_etcd_cluster: EtcdCluster):
    _raft_leadership_to_the_last_member(fresh_etcd_cluster)
    found = wait_until(lambda: _leader(replicas), 30)
    leader, epoch = found
    with httpx.Client(timeout=10) as c:
        assert c.post(f"{leader.url}/v1/leases", json=lease_body("eu-slow-000001", "p1", "eu", 1)).status_code == 200
        for member in (0, 1):
            time.sleep(1.3)  # a keepalive or two on the member about to stall
            fresh_etcd_cluster.procs[member].signal(signal.SIGSTOP)
            try:
                time.sleep(PAUSE_S)
            finally:
                fresh_etcd_cluster.procs[member].signal(signal.SIGCONT)
        time.sleep(1.0)
        now = _leader(replicas)
        assert now is not None and now[0] is leader and now[1] == epoch, (
            f"leadership moved from {leader.node_id} epoch {epoch} to {now}:\n{leader.proc.tail()}")
        r = c.post(f"{leader.url}/v1/leases", json=lease_body("eu-slow-000002", "p1", "eu", 1))
        assert r.status_code == 200 and r.json()["epoch"] == epoch, r.text
        assert leader.proc.log_path is not None and "steps down" not in leader.proc.log_path.read_text()
