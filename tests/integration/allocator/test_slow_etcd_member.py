"""One etcd member that stops answering for a few seconds (SIGSTOP: a stalled disk, a GC pause, a
hung host), under two ``python -m allocator`` replicas run with the default ``--etcd-timeout-ms``
(2000) and ``--election-ttl-s`` (3), the member first in both replicas' endpoint lists: the
leader's calls move on to the next member and it keeps its etcd lease, its leadership and its
epoch (no failover for one slow member of a healthy cluster). The other test helpers run the
allocator with a 1000 ms call bound; this one checks the defaults an operator runs."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernel.bundle import Pool
from leasehold.local.procs import EtcdCluster
from tests.support.waiting import wait_until

from .helpers import AllocatorProcess, lease_body, unique_prefix, write_bundle

PAUSE_S = 3.0


@pytest.fixture
def replicas(tmp_path: Path, fresh_etcd_cluster: EtcdCluster) -> Iterator[list[AllocatorProcess]]:
    bundle = write_bundle(tmp_path / "pools.json", [Pool(id="p1", window_ms=60_000, limit=100_000, chunk_max=10)])
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


def test_one_stalled_etcd_member_does_not_move_the_allocator_leadership(
        replicas: list[AllocatorProcess], fresh_etcd_cluster: EtcdCluster):
    found = wait_until(lambda: _leader(replicas), 30)
    leader, epoch = found
    with httpx.Client(timeout=10) as c:
        assert c.post(f"{leader.url}/v1/leases", json=lease_body("eu-slow-000001", "p1", "eu", 1)).status_code == 200
        time.sleep(1.5)  # a keepalive or two on the member about to stall
        fresh_etcd_cluster.procs[0].signal(signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            fresh_etcd_cluster.procs[0].signal(signal.SIGCONT)
        time.sleep(1.0)
        now = _leader(replicas)
        assert now is not None and now[0] is leader and now[1] == epoch, (
            f"leadership moved from {leader.node_id} epoch {epoch} to {now}:\n{leader.proc.tail()}")
        r = c.post(f"{leader.url}/v1/leases", json=lease_body("eu-slow-000002", "p1", "eu", 1))
        assert r.status_code == 200 and r.json()["epoch"] == epoch, r.text
        assert leader.proc.log_path is not None and "steps down" not in leader.proc.log_path.read_text()
