"""Helpers of the allocator's integration tests alone: etcd's windows and grants as the allocator
stored them, a leader deposed as another node would, a replayed grant compared with the stored one,
and ``python -m allocator`` subprocesses. The in-process app, its settings and bundle files are
shared (:mod:`tests.support.allocator_app`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import msgspec

from allocator.allocation import WindowState
from allocator.records import GrantRecord
from kernel.etcd_store import EtcdStore, TxnBuilder
from leasehold.local.procs import LOOPBACK, EtcdCluster, Proc, free_port, wait_port
from leasehold.local.services import allocator_command

ROOT = Path(__file__).resolve().parents[3]


async def etcd_windows(store: EtcdStore, prefix: str, pool: str) -> dict[int, WindowState]:
    kvs = await store.get_prefix(f"{prefix}pools/{pool}/".encode())
    return {int(kv.key.rsplit(b"/", 1)[1]): msgspec.json.decode(kv.value, type=WindowState) for kv in kvs}


async def etcd_grants(store: EtcdStore, prefix: str) -> dict[str, GrantRecord]:
    kvs = await store.get_prefix(f"{prefix}grants/".encode())
    return {kv.key.rsplit(b"/", 1)[1].decode(): msgspec.json.decode(kv.value, type=GrantRecord) for kv in kvs}


async def usurp(store: EtcdStore, key: bytes, epoch: int) -> int:
    """Depose the leader of ``key`` (epoch ``epoch``) as another node would: delete the key, then
    create it again on a new etcd lease (a new create_revision = a new epoch); that lease's id."""
    lease = await store.lease_grant(30)
    txn = TxnBuilder()
    txn.created_at(key, epoch)
    txn.delete(key)
    assert (await store.commit(txn)).succeeded
    txn = TxnBuilder()
    txn.absent(key)
    txn.put(key, msgspec.json.encode({"nodeId": "usurper", "url": "http://x:1"}), lease)
    assert (await store.commit(txn)).succeeded
    return lease


RELATIVE = ("ttlMs", "startsInMs", "replayed")


def assert_replay_of(replay: dict, first: dict) -> None:
    """A replayed grant is the stored one: every field identical except ``replayed`` and the two
    timings relative to the answer, which only shrink (to what is left of the stored expiry)."""
    assert replay["replayed"] is True and first["replayed"] is False
    assert {k: v for k, v in replay.items() if k not in RELATIVE} == \
        {k: v for k, v in first.items() if k not in RELATIVE}
    assert 0 <= replay["ttlMs"] <= first["ttlMs"]
    assert 0 <= replay["startsInMs"] <= first["startsInMs"]


class AllocatorProcess:
    """``python -m allocator`` as a real subprocess on a free port."""

    def __init__(self, workdir: Path, cluster: EtcdCluster, bundle: Path, prefix: str, node_id: str,
                 election_ttl_s: int = 2, settings: dict[str, Any] | None = None):
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        args = allocator_command(etcd=cluster.endpoints, policy=bundle, node_id=node_id, host=LOOPBACK, port=self.port,
                                 prefix=prefix, election_ttl_s=election_ttl_s,
                                 **{"etcd_timeout_ms": 1000, "log_level": "info", **(settings or {})})
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = Proc(f"allocator-{node_id}", args, workdir / node_id, env=env)
        self.node_id = node_id

    def start(self) -> AllocatorProcess:
        self.proc.start()
        wait_port(self.port, proc=self.proc.popen, timeout=30)
        return self

    def start_wait(self) -> AllocatorProcess:
        """Wait for a process started with ``proc.start()`` to listen (start several, then wait)."""
        wait_port(self.port, proc=self.proc.popen, timeout=30)
        return self

    def leader_info(self) -> dict | None:
        try:
            return httpx.get(f"{self.url}/v1/leader", timeout=2).json()
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        self.proc.stop()
