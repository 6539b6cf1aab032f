"""Keep etcd's history short: one replica compacts it periodically.

etcd keeps every version of every key until its history is compacted, and the allocator
rewrites a window record in every transaction and a grant record with every usage report, so a
deployment that never compacts fills etcd's backend quota (2 GiB by default) and etcd then
refuses every write (the ``NOSPACE`` alarm) — every grant fails.

Every ``interval_s`` the replica leading shard 0 (unsharded: the leader) reads etcd's current
revision; if it read one an interval ago under the same epoch, it records that older revision in
``<prefix>compaction`` (``{"revision", "atMs", "nodeId"}``) with a transaction comparing its
epoch — fenced like every leader write, so a deposed replica does not compact — and compacts
etcd to it. History of one to two intervals is kept; the same scheme as kube-apiserver's
``--etcd-compaction-interval`` (compact to the revision seen one interval before).

What needs history: nothing in Leasehold reads an old revision. The writer and the election
read the latest values and compare ``create_revision``/``mod_revision`` of live keys, which
compaction keeps (it removes only superseded versions). The policy watchers watch from "now";
one that falls behind a compaction is cancelled by etcd and re-established, and the periodic
re-read covers the gap (``kernel/watch.py``). The interval of history is for operators
(``etcdctl get --rev``) and slow watchers. Compaction is cluster-wide: with an etcd shared with
other applications that need longer history, set the interval to 0 and run etcd with its own
``--auto-compaction-mode``/``--auto-compaction-retention``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdStore, TxnBuilder

from .metrics import AllocatorMetrics
from .transactions import Leadership

log = logging.getLogger(__name__)


class CompactionRecord(msgspec.Struct, rename="camel"):
    revision: int
    at_ms: int
    node_id: str


class Compactor:
    def __init__(self, store: EtcdStore, election: Leadership, key: bytes, *, node_id: str, interval_s: float,
                 metrics: AllocatorMetrics | None = None, clock: Callable[[], float] = time.time):
        self.store = store
        self.election = election
        self.key = key
        self.node_id = node_id
        self.interval_s = interval_s
        self.metrics = metrics
        self.clock = clock
        self._seen: tuple[int, int] | None = None  # (epoch, revision) read at the last tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="allocator-compaction")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except LeaseholdError as e:
                log.warning("etcd compaction skipped: %s", e.detail)
            except Exception:  # noqa: BLE001 - keep compacting later; log the bug
                log.exception("etcd compaction failed")

    async def tick(self) -> int | None:
        """One period: the revision compacted to, or None (not leading shard 0, the first period
        of an epoch, fenced, or etcd already compacted past it)."""
        epoch = self.election.epoch_of(0)
        if epoch is None:
            self._seen = None
            return None
        now_rev = await self.store.revision(self.key)
        seen, self._seen = self._seen, (epoch, now_rev)
        if seen is None or seen[0] != epoch:
            return None
        target = seen[1]
        txn = TxnBuilder()
        txn.created_at(self.election.leader_key(0), epoch)
        txn.put(self.key, msgspec.json.encode(CompactionRecord(revision=target, at_ms=int(self.clock() * 1000),
                                                               node_id=self.node_id)))
        if not (await self.store.commit(txn)).succeeded:
            return None  # deposed meanwhile: the election notices on its own
        if not await self.store.compact(target):
            return None
        log.info("etcd history compacted to revision %d (current %d)", target, now_rev)
        if self.metrics is not None:
            self.metrics.compactions.inc()
            self.metrics.compacted_revision.set(target)
        return target
