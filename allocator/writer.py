"""The leader's writer: what the routes call to grant leases, take usage reports and read records.

It puts together the parts of the write path, each in its own module:

* :mod:`allocator.committer` — the queue and the committer task (group commit, up to four
  transactions in flight on disjoint pools, callers waiting on one future per request or batch);
* :mod:`allocator.transactions` — one transaction loop with two strategies (grants, usage
  reports): fencing by the shard's epoch, idempotency, conflicts, replays;
* :mod:`allocator.window_cache` — the windows' state in memory, read again after a leadership
  change (the one place that invalidates anything);
* :mod:`allocator.allocation` — the pure decisions.

A request is accepted only while this replica leads the pool's shard (``require_leader``: the
epoch it is stamped and fenced with, or 503 not-leader naming the leader). Records:
:mod:`allocator.records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from kernel.bundle import Pool
from kernel.errors import LeaseholdError, NotFound
from kernel.etcd_store import EtcdStore
from kernel.wire import (
    LeaseError,
    LeaseGrant,
    LeaseRequest,
    PoolSummary,
    PoolWindowView,
    RegionShare,
    UsageReceipt,
    UsageReport,
)

from . import allocation
from .committer import Committer, Item, OpenWrites, ReportItem, Wait
from .grouping import Unit
from .metrics import AllocatorMetrics
from .records import GrantRecord, Keys
from .transactions import Leadership, TransactionLoop, check_same, lookup_pool
from .window_cache import WindowCache

log = logging.getLogger(__name__)
R = TypeVar("R", LeaseRequest, UsageReport)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Writer:
    def __init__(self, store: EtcdStore, election: Leadership, pools: Iterable[Pool], *, keys: Keys,
                 open_writes: OpenWrites, metrics: AllocatorMetrics, clock: Callable[[], int] = wall_ms,
                 max_attempts: int = 5):
        self.store = store
        self.election = election
        self.keys = keys
        self.metrics = metrics
        self.clock = clock
        self._pools: dict[str, Pool] = {p.id: p for p in pools}
        self.cache = WindowCache(store, keys, lambda: self._pools, metrics)
        self.committer = Committer(self._run_unit, open_writes, lambda: store.max_txn_ops)
        self.transactions = TransactionLoop(store, keys, election, self.cache, self.committer, metrics,
                                            pools=lambda: self._pools, clock=clock, max_attempts=max_attempts)
        self._discovery: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.committer.start()
        if not self.store.txn_ops_known:
            self._discovery = asyncio.create_task(self._discover(), name="allocator-txn-limit")

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        await self.committer.stop()

    async def _discover(self) -> None:
        """Learn etcd's --max-txn-ops (a read-only probe; retried until etcd answers)."""
        while True:
            try:
                n = await self.store.discover_max_txn_ops(self.keys.leader)
                log.info("etcd accepts %d ops per transaction branch: up to %d grants per transaction", n,
                         (n - 1) // 2)
                return
            except LeaseholdError as e:
                log.debug("etcd --max-txn-ops probe failed (%s); using %d for now", e.code, self.store.max_txn_ops)
                await asyncio.sleep(1.0)

    async def _run_unit(self, unit: Unit[Item]) -> None:
        await self.transactions.run_unit(unit)

    # -- pools ----------------------------------------------------------------------------------
    @property
    def pools(self) -> Mapping[str, Pool]:
        return self._pools

    def use_pools(self, pools: Iterable[Pool]) -> None:
        """The pools of a newly accepted bundle: replaced in one assignment, so a grant decision
        sees one bundle's pools."""
        self._pools = {p.id: p for p in pools}

    def pool(self, pool_id: str) -> Pool:
        return lookup_pool(self._pools, pool_id)

    def summaries(self) -> list[PoolSummary]:
        return [PoolSummary(id=p.id, limit=p.limit, window_ms=p.window_ms, lease_ttl_ms=p.lease_ttl_ms,
                            chunk_min=p.chunk_min, chunk_max=p.chunk_max,
                            fallback_per_region=p.fallback_per_region) for p in self._pools.values()]

    # -- writes ---------------------------------------------------------------------------------
    async def grant(self, req: LeaseRequest) -> LeaseGrant:
        result: LeaseGrant = await self._one(req, self._enqueue_grant)
        return result

    async def grant_many(self, reqs: Sequence[LeaseRequest]) -> list[LeaseGrant | LeaseError]:
        """Every item queued at once (the committer groups them into few transactions); one wait
        for all of them. A cancelled caller leaves the items to be committed and answered."""
        return await self._many(reqs, self._enqueue_grant)

    async def report(self, report: UsageReport) -> UsageReceipt:
        result: UsageReceipt = await self._one(report, self._enqueue_report)
        return result

    async def report_many(self, reports: Sequence[UsageReport]) -> list[UsageReceipt | LeaseError]:
        """Usage reports of many leases: queued at once and committed in few transactions (the
        committer groups them like grants); results in request order, each decided exactly like
        :meth:`report` (the region's own lease namespace, ``closedEarly``, spend history)."""
        return await self._many(reports, self._enqueue_report)

    async def _one(self, req: R, enqueue: Callable[[R, Wait], Item]) -> Any:
        """Queue one item and wait for its answer (raises its error)."""
        wait = Wait()
        item = enqueue(req, wait)
        await wait.wait()
        return item.outcome()

    async def _many(self, reqs: Sequence[R], enqueue: Callable[[R, Wait], Item]) -> list[Any]:
        """Queue every item at once, wait once; results (or per-item errors) in request order."""
        wait = Wait()
        items: list[Item | LeaseError] = []
        for r in reqs:
            try:
                items.append(enqueue(r, wait))
            except LeaseholdError as e:
                items.append(_lease_error(r.lease_id, e))
        await wait.wait()
        return [it if isinstance(it, LeaseError) else it.result if it.error is None
                else _lease_error(it.req.lease_id, it.error) for it in items]

    def _enqueue_grant(self, req: LeaseRequest, wait: Wait) -> Item:
        """Queue a grant for the committer, or join the one queued for the same lease id."""
        pool = self._pools.get(req.pool) or self.pool(req.pool)
        allocation.check_region(pool, req.region)
        existing = self.committer.queued_grant(req.region, req.lease_id)
        if existing is not None:
            first: LeaseRequest = existing.req
            check_same(req, pool=first.pool, region=first.region, want=first.want, demand=first.demand,
                       window=first.window)
            joiner = Item(req, wait, existing.shard, existing.epoch)
            existing.joiners.append(joiner)  # answered with the first one's outcome
            return joiner
        return self._queue(Item, req, wait)

    def _enqueue_report(self, report: UsageReport, wait: Wait) -> Item:
        self.pool(report.pool)
        return self._queue(ReportItem, report, wait)

    def _queue(self, kind: type[Item], req: LeaseRequest | UsageReport, wait: Wait) -> Item:
        """Stamp the item with its shard's epoch (``NotLeader`` unless this replica leads the
        shard) and hand it to the committer (``Unavailable`` when its backlog is full)."""
        shard = self.election.shard_of(req.pool)  # kernel.shards.shard_of: memoised there, once per pool
        epoch = self.election.require_leader(shard)
        self.committer.check_backlog()
        item = kind(req, wait, shard, epoch)
        self.committer.queue(item)
        return item

    # -- reads (any replica) --------------------------------------------------------------------
    async def get_record(self, region: str, lease_id: str) -> GrantRecord:
        kv = await self.store.get(self.keys.grant(region, lease_id))
        if kv is None:
            raise NotFound(f"no lease {lease_id!r} for region {region!r}")
        return msgspec.json.decode(kv.value, type=GrantRecord)

    async def window_view(self, pool_id: str) -> PoolWindowView:
        pool = self.pool(pool_id)
        k = allocation.window_index(self.clock(), pool.window_ms)
        kv = await self.store.get(self.keys.window(pool.id, k))
        state = allocation.new_window(pool, k) if kv is None else msgspec.json.decode(
            kv.value, type=allocation.WindowState)
        regions = sorted(set(state.granted) | set(state.leases) | set(state.returned))
        return PoolWindowView(
            pool=pool.id, limit=state.limit, window=allocation.window_ref(k, pool.window_ms),
            remaining=state.remaining, granted=state.total_granted - state.total_returned,
            regions=[RegionShare(region=r, granted=state.granted.get(r, 0), leases=state.leases.get(r, 0),
                                 returned=state.returned.get(r, 0)) for r in regions],
            leases_outstanding=state.leases_outstanding)


def _lease_error(lease_id: str, e: LeaseholdError) -> LeaseError:
    return LeaseError(lease_id=lease_id, status=e.status, code=e.code, detail=e.detail)
