"""The leader's writer: a queue, group commit in a pipeline, idempotency, fencing, reclaim.

Every write (a grant or a usage report) is queued; one committer task groups what is queued
into *units* (:mod:`allocator.grouping`: pools exclusive, queue order per pool, one epoch per
shard, etcd's op and byte limits) and runs up to ``TXNS_IN_FLIGHT`` of them at once, each one
etcd transaction, so Python decides the next while etcd commits one. It keeps each active
window's state in memory (with the window key's ``mod_revision``) and decides grants with
:mod:`allocator.policy` *on that state, in place* (a window is in one unit at a time; a unit
that does not commit drops the windows it touched, and they are read again). A grant unit's
transaction compares

* ``create_revision(leader key of the pool's shard) == epoch`` for every shard the transaction
  writes (fencing: a deposed or paused leader cannot commit; one shard and the key ``leader``
  unless the deployment is sharded, see :mod:`allocator.shards`; built in :meth:`Engine._fence_compares`),
* each touched window key's ``mod_revision`` (or ``version == 0`` when new),
* each new grant key's ``version == 0`` (idempotency: a stored record is never overwritten).

A usage unit reads its grant records (one read for the unit), decides each reclaim, and commits
the windows and the updated records in one transaction comparing the same epochs, each record's
``mod_revision`` as read and each window's.

On a failed compare the unit reads back the leader keys, the windows and the grant keys: a
changed epoch fences that shard's writes (nothing granted, step down from the shard), existing
grant records are answered as replays, changed windows are reloaded and the rest retried
(bounded). Nothing is ever granted from memory alone: an answer is returned only after its
transaction committed.

Transactions are built as etcd's protobuf ``TxnRequest`` directly (``kernel.etcd_store.TxnBuilder``)
and carry up to etcd's ``--max-txn-ops`` (discovered from the cluster, or configured). Callers
wait on one future per request or batch (:class:`_Wait`), not one per item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import msgspec

from kernel import tracing
from kernel.bundle import Pool
from kernel.errors import (
    Conflict,
    Fenced,
    LeaseholdError,
    NotFound,
    Unavailable,
)
from kernel.etcd_store import (
    KV,
    EtcdLeaseMissing,
    EtcdStore,
    EtcdTxnTooLarge,
    LeaseBuckets,
    TxnBuilder,
)
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

from . import policy
from .grouping import WINDOW_BYTES, Unit, form_units
from .metrics import AllocatorMetrics

log = logging.getLogger("allocator.engine")

RECORD_MIN_LINGER_MS = 60_000
TXNS_IN_FLIGHT = 4  # units (transactions) the committer runs at once, on disjoint pools
BUSY_MIN_UNIT = 64  # while a unit is in flight, another starts only with this many writes queued
MIN_UNIT = 128  # what is queued is spread over the free slots, no unit smaller than this: bigger transactions cost
# etcd and us less per grant, two or more in flight let Python and etcd work side by side (leasehold/bench/README.md)
MAX_TXN_BYTES = 1_000_000  # estimated request size per transaction: below etcd's default --max-request-bytes (1.5 MiB)
MIN_TXN_BYTES = 64_000
MAX_QUEUE = 16_384  # queued writes; beyond this the leader sheds load with a retriable 503


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class GrantRecord(msgspec.Struct, rename="camel"):
    """What ``grants/<region>/<leaseId>`` holds: the grant as answered, plus its usage report."""

    grant: LeaseGrant
    demand: int = 0
    reported: bool = False
    spent: int = 0
    returned: int = 0
    stranded: int = 0
    window_open: bool = False


class _Cached:
    """A window's state as this leader last read or committed it."""

    __slots__ = ("state", "mod_revision", "key", "lease", "lease_gen")

    def __init__(self, state: policy.WindowState, mod_revision: int, key: bytes):
        self.state = state
        self.mod_revision = mod_revision  # 0 = not in etcd yet
        self.key = key
        self.lease = 0  # the etcd lease its records are put with (LeaseBuckets generation lease_gen)
        self.lease_gen = -1


class _Wait:
    """One caller's wait: a request or a whole batch. One future, set when its last item is answered
    (no future, callback or task per item)."""

    __slots__ = ("fut", "open")

    def __init__(self) -> None:
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.open = 0

    def one_done(self) -> None:
        self.open -= 1
        if self.open == 0 and not self.fut.done():
            self.fut.set_result(None)

    async def wait(self) -> None:
        if self.open:
            await self.fut


class _Item:
    """A grant request on its way through the committer (a :class:`allocator.grouping.Queued`)."""

    __slots__ = ("req", "wait", "shard", "epoch", "pool", "result", "error", "done", "joiners", "trace")
    is_grant = True

    def __init__(self, req: Any, wait: _Wait, shard: int, epoch: int):
        self.req = req
        self.wait = wait
        self.shard = shard
        self.epoch = epoch  # the epoch this replica led the pool's shard with when it accepted the request
        self.pool: str = req.pool
        self.result: Any = None
        self.error: LeaseholdError | None = None
        self.done = False
        self.joiners: list[_Item] = []  # requests for the same lease id that arrived while this one was queued
        self.trace = tracing.current_context() if tracing.ENABLED else None  # its request's span (a commit links it)
        wait.open += 1

    @property
    def window_choice(self) -> str:
        return self.req.window  # type: ignore[no-any-return]

    @property
    def lease_id(self) -> str:
        return self.req.lease_id  # type: ignore[no-any-return]

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class _Report(_Item):
    """A usage report on its way through the committer."""

    __slots__ = ()
    is_grant = False

    @property
    def window_choice(self) -> str:
        return ""


class Leadership(Protocol):
    """Who may write which pool: :class:`allocator.election.Election` (one shard, key ``leader``)
    or :class:`allocator.shard_election.ShardElection` (``leader/<shard>``)."""

    shards: int

    def shard_of(self, pool: str) -> int: ...

    def leader_key(self, shard: int) -> bytes: ...

    def require_leader(self, shard: int = 0) -> int: ...  # the shard's epoch, or NotLeader naming its leader

    def epoch_of(self, shard: int) -> int | None: ...

    def step_down(self, reason: str, shard: int | None = None) -> None: ...


@dataclass
class Keys:
    prefix: str

    @property
    def leader(self) -> bytes:
        return f"{self.prefix}leader".encode()

    def window(self, pool: str, index: int) -> bytes:
        return f"{self.prefix}pools/{pool}/{index}".encode()

    def grant(self, region: str, lease_id: str) -> bytes:
        """A lease id is the idempotency key of the region that minted it: one namespace per
        region, so no region can learn whether another region used an id (or claim it)."""
        return f"{self.prefix}grants/{region}/{lease_id}".encode()

    def pool_prefix(self, pool: str) -> bytes:
        return f"{self.prefix}pools/{pool}/".encode()

    def grants_prefix(self) -> bytes:
        return f"{self.prefix}grants/".encode()


@dataclass
class Engine:
    store: EtcdStore
    election: Leadership
    pools: dict[str, Pool]
    prefix: str = "/leasehold/"
    metrics: AllocatorMetrics = field(default_factory=AllocatorMetrics)
    clock: Callable[[], int] = wall_ms
    max_attempts: int = 5

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self._ready: deque[_Item] = deque()  # queued, in arrival order
        self._wakeup: asyncio.Future[None] | None = None  # the committer's sleep
        self._running: dict[asyncio.Task[None], Unit] = {}
        self._busy: set[str] = set()  # pools of the units in flight
        self._held: set[tuple[str, int]] = set()  # windows the units in flight decide on (never pruned)
        self._inflight: dict[tuple[str, str], _Item] = {}  # (region, lease id) -> its queued grant (a retry joins it)
        self._cache: dict[tuple[str, int], _Cached] = {}
        self._window_bytes: dict[str, int] = {}  # pool -> size of its last window record (unit budgets)
        self._last_prune_ms = 0  # wall ms of the last cache scan (_prune_cache)
        self._buckets = LeaseBuckets(self.store)
        self._task: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._txn_bytes = MAX_TXN_BYTES
        self._encode = msgspec.json.Encoder().encode
        self._shards: dict[str, int] = {}  # pool -> shard (a hash: computed once per pool)
        self._granted: dict[tuple[str, str], list[int]] = {}  # (pool, region) -> [grants, tokens] not yet in metrics
        self._open: dict[int, int] = {}  # shard -> accepted writes not answered yet (for a handoff's drain)
        self._idle: dict[int, asyncio.Event] = {}  # set when a drained shard's last write is answered
        self.metrics.add_flush(self.flush_metrics)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._committer(), name="allocator-committer")
        if not self.store.txn_ops_known:
            self._discovery = asyncio.create_task(self._discover(), name="allocator-txn-limit")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._discovery, *self._running) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        while self._ready:
            self._answer(self._ready.popleft(), error=Unavailable("allocator shutting down"))

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

    def invalidate(self, shard: int | None = None) -> None:
        """Forget cached window state (of one shard's pools, or all) on a leadership change."""
        if shard is None:
            self._cache.clear()
            self._buckets.forget()
            return
        for wk in [wk for wk in self._cache if self._shard_of(wk[0]) == shard]:
            del self._cache[wk]

    async def drain(self, shard: int) -> None:
        """Wait until every write accepted for ``shard`` has been answered (a handoff calls this
        after it stopped accepting the shard, with its own time bound)."""
        while self._open.get(shard):
            await self._idle.setdefault(shard, asyncio.Event()).wait()

    def flush_metrics(self) -> None:
        """Move the grant counts kept per (pool, region) since the last scrape into the counters
        (one labelled increment per pair and scrape instead of two per grant)."""
        counts, self._granted = self._granted, {}
        m = self.metrics
        for (pool, region), (grants, tokens) in counts.items():
            label = m.region(region)
            m.grants.labels(pool, label).inc(grants)
            m.granted_tokens.labels(pool, label).inc(tokens)

    # -- public API -----------------------------------------------------------------------------
    def pool(self, pool_id: str) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"no pool {pool_id!r} (known: {', '.join(sorted(self.pools)) or 'none'})")
        return pool

    def summaries(self) -> list[PoolSummary]:
        return [PoolSummary(id=p.id, limit=p.limit, window_ms=p.window_ms, lease_ttl_ms=p.lease_ttl_ms,
                            chunk_min=p.chunk_min, chunk_max=p.chunk_max,
                            fallback_per_region=p.fallback_per_region) for p in self.pools.values()]

    async def grant(self, req: LeaseRequest) -> LeaseGrant:
        return await self._one(req, self._enqueue_grant)  # type: ignore[no-any-return]

    async def grant_many(self, reqs: Sequence[LeaseRequest]) -> list[LeaseGrant | LeaseError]:
        """Every item queued at once (the committer groups them into few transactions); one wait
        for all of them. A cancelled caller leaves the items to be committed and answered."""
        return await self._many(reqs, self._enqueue_grant)

    async def report(self, report: UsageReport) -> UsageReceipt:
        return await self._one(report, self._enqueue_report)  # type: ignore[no-any-return]

    async def report_many(self, reports: Sequence[UsageReport]) -> list[UsageReceipt | LeaseError]:
        """Usage reports of many leases: queued at once and committed in few transactions (the
        committer groups them like grants); results in request order, each decided exactly like
        :meth:`report` (the region's own lease namespace, ``closedEarly``, spend history)."""
        return await self._many(reports, self._enqueue_report)

    def _cache_committed(self, windows: dict, revision: int) -> None:
        """The unit's windows as committed at ``revision`` (cached again, if a leadership change
        dropped them meanwhile)."""
        for wk, c in windows.items():
            c.mod_revision = revision
            self._cache[wk] = c

    async def _commit_unit(self, txn: Any, wks: Any, pending: list, kind: str, windows: dict,
                           committed: Callable[[], None]) -> bool | None:
        """Commit one unit's transaction. True: done - committed (its ``windows`` cached at the
        commit's revision, then ``committed()`` answers its items), or etcd refused its size and
        the unit went back to the queue split; None: the etcd lease was lost (reload, build
        again); False: a compare failed (the unit's windows dropped, counted): find out which."""
        try:
            res = await self.store.commit(txn)
        except EtcdLeaseMissing:
            self._drop(wks)
            self._buckets.forget()
            self.metrics.txn_retries.labels(kind).inc()
            return None
        except EtcdTxnTooLarge as e:
            self._drop(wks)
            if len(pending) == 1:
                raise
            self._requeue(pending, txn, e)
            return True
        except BaseException:
            self._drop(wks)  # the outcome may be unknown: reload before the next use
            raise
        if res.succeeded:
            self._cache_committed(windows, res.revision)
            committed()
            return True
        self._drop(wks)
        self.metrics.txn_conflicts.labels(kind).inc()
        return False

    async def _one(self, req: Any, enqueue: Callable[[Any, _Wait], _Item]) -> Any:
        """Queue one item and wait for its answer (raises its error)."""
        wait = _Wait()
        item = enqueue(req, wait)
        await wait.wait()
        return item.outcome()

    async def _many(self, reqs: Sequence[Any], enqueue: Callable[[Any, _Wait], _Item]) -> list[Any]:
        """Queue every item at once, wait once; results (or per-item errors) in request order."""
        wait = _Wait()
        items: list[_Item | LeaseError] = []
        for r in reqs:
            try:
                items.append(enqueue(r, wait))
            except LeaseholdError as e:
                items.append(_lease_error(r.lease_id, e))
        await wait.wait()
        return [it if isinstance(it, LeaseError) else it.result if it.error is None
                else _lease_error(it.req.lease_id, it.error) for it in items]

    async def get_record(self, region: str, lease_id: str) -> GrantRecord:
        kv = await self.store.get(self.keys.grant(region, lease_id))
        if kv is None:
            raise NotFound(f"no lease {lease_id!r} for region {region!r}")
        return msgspec.json.decode(kv.value, type=GrantRecord)

    async def window_view(self, pool_id: str) -> PoolWindowView:
        pool = self.pool(pool_id)
        k = policy.window_index(self.clock(), pool.window_ms)
        kv = await self.store.get(self.keys.window(pool.id, k))
        state = policy.new_window(pool, k) if kv is None else msgspec.json.decode(kv.value,
                                                                                   type=policy.WindowState)
        regions = sorted(set(state.granted) | set(state.leases) | set(state.returned))
        return PoolWindowView(
            pool=pool.id, limit=state.limit, window=policy.window_ref(k, pool.window_ms),
            remaining=state.remaining, granted=state.total_granted - state.total_returned,
            regions=[RegionShare(region=r, granted=state.granted.get(r, 0), leases=state.leases.get(r, 0),
                                 returned=state.returned.get(r, 0)) for r in regions],
            leases_outstanding=state.leases_outstanding)

    # -- submission -----------------------------------------------------------------------------
    def _shard_of(self, pool: str) -> int:
        shard = self._shards.get(pool)
        if shard is None:
            if len(self._shards) >= 1_000_000:
                self._shards.clear()
            shard = self._shards[pool] = self.election.shard_of(pool)
        return shard

    def _enqueue_grant(self, req: LeaseRequest, wait: _Wait) -> _Item:
        """Queue a grant for the committer, or join the one queued for the same lease id."""
        pool = self.pools.get(req.pool) or self.pool(req.pool)
        policy.check_region(pool, req.region)
        existing = self._inflight.get((req.region, req.lease_id))
        if existing is not None:
            _check_same(existing.req.pool, existing.req.region, req)
            joiner = _Item(req, wait, existing.shard, existing.epoch)
            existing.joiners.append(joiner)  # answered with the first one's outcome
            return joiner
        shard = self._shards.get(req.pool)
        if shard is None:
            shard = self._shard_of(req.pool)
        epoch = self.election.require_leader(shard)
        self._check_backlog()
        item = _Item(req, wait, shard, epoch)
        self._inflight[(req.region, req.lease_id)] = item
        self._queue(item)
        return item

    def _enqueue_report(self, report: UsageReport, wait: _Wait) -> _Report:
        self.pool(report.pool)
        shard = self._shard_of(report.pool)
        epoch = self.election.require_leader(shard)
        self._check_backlog()
        item = _Report(report, wait, shard, epoch)
        self._queue(item)
        return item

    def _queue(self, item: _Item) -> None:
        self._open[item.shard] = self._open.get(item.shard, 0) + 1
        self._ready.append(item)
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    def _check_backlog(self) -> None:
        if len(self._ready) >= MAX_QUEUE:
            raise Unavailable(f"allocator leader overloaded ({MAX_QUEUE} writes queued); retry shortly")

    def _answer(self, item: _Item, result: Any = None, error: LeaseholdError | None = None) -> None:
        """Settle a queued item (once) and the requests that joined it."""
        if item.done:
            return
        for it in (item, *item.joiners):
            it.done, it.result, it.error = True, result, error
            it.wait.one_done()
        if item.is_grant:
            key = (item.req.region, item.req.lease_id)
            if self._inflight.get(key) is item:
                del self._inflight[key]
        left = self._open[item.shard] = self._open[item.shard] - 1
        if not left and (idle := self._idle.pop(item.shard, None)) is not None:
            idle.set()

    # -- committer ------------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _committer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            running = len(self._running)
            free = TXNS_IN_FLIGHT - running
            units: list[Unit] = []
            # group commit: with a transaction in flight, a few queued writes wait for it to finish
            # and go out together (one transaction for many single requests); enough of them to
            # fill a transaction go out at once, so etcd and Python work side by side
            if self._ready and free > 0 and (not running or len(self._ready) >= BUSY_MIN_UNIT):
                per_unit = max(MIN_UNIT, -(-len(self._ready) // free))
                units, left = form_units(self._ready, busy=self._busy, free=free, per_unit=per_unit,
                                         max_ops=self.store.max_txn_ops, max_bytes=self._txn_bytes,
                                         window_bytes=self._window_size)
                self._ready = deque(left)
                for unit in units:
                    task = loop.create_task(self._run_unit(unit))
                    self._running[task] = unit
                    self._busy |= unit.pools
                    task.add_done_callback(self._unit_done)
            if not units:  # nothing queued, no free slot, or every queued pool busy: wait for a change
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None

    def _window_size(self, pool: str) -> int:
        return self._window_bytes.get(pool, WINDOW_BYTES)

    def _unit_done(self, task: asyncio.Task[None]) -> None:
        unit = self._running.pop(task)
        self._busy -= unit.pools
        self._wake()

    async def _run_unit(self, unit: Unit) -> None:
        traces = [it.trace for it in unit.items if it.trace is not None] if tracing.ENABLED else []
        if not traces:
            return await self._run_unit_now(unit)
        # one transaction for requests of several traces: the first request's span is its parent,
        # every request's span is linked
        with tracing.span("leasehold.allocator_commit", parent=traces[0], links=traces,
                          attributes={"leasehold.kind": "grants" if unit.is_grant else "reports",
                                      "leasehold.items": len(unit.items),
                                      "leasehold.pools": sorted(unit.pools)}):
            await self._run_unit_now(unit)

    async def _run_unit_now(self, unit: Unit) -> None:
        items = unit.items
        held: set[tuple[str, int]] = set()
        try:
            if unit.is_grant:
                await self._commit_grants(items, held)
            else:
                await self._commit_reports(items, held)
        except asyncio.CancelledError:
            for it in items:
                self._answer(it, error=Unavailable("allocator shutting down"))
            raise
        except LeaseholdError as e:
            for it in items:
                self._answer(it, error=e)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the committer
            log.exception("committer error")
            for it in items:
                self._answer(it, error=Unavailable(f"internal allocator error ({type(e).__name__})"))
        finally:
            self._held -= held

    def _requeue(self, items: list[_Item], txn: TxnBuilder, refusal: EtcdTxnTooLarge) -> None:
        """etcd refused a transaction for its size: queue its items again (first, in order) for
        smaller units. For its op count the store lowered its limit already; for its bytes the
        unit byte budget is lowered here."""
        if refusal.bytes_limit:
            lowered = max(MIN_TXN_BYTES, min(self._txn_bytes, txn.request.ByteSize()) // 2)
            if lowered < self._txn_bytes:
                log.error("etcd refused a transaction of %d bytes (its --max-request-bytes): using %d bytes "
                          "per transaction from now on", txn.request.ByteSize(), lowered)
            self._txn_bytes = lowered
        self._ready.extendleft(reversed([it for it in items if not it.done]))

    # -- fencing: the one place a write is tied to its shard's epoch ----------------------------
    def _fence_compares(self, txn: TxnBuilder, fence: dict[int, int]) -> None:
        """``create_revision(leader key of shard) == epoch`` for each shard -> epoch a transaction
        writes: etcd refuses the whole transaction if any of them was deposed meanwhile."""
        for shard, epoch in fence.items():
            txn.created_at(self.election.leader_key(shard), epoch)

    def _deposed(self, fence: dict[int, int], found: dict[bytes, KV]) -> dict[int, int]:
        """The shards (-> epoch) of ``fence`` whose leader key, read after a failed compare, no
        longer carries the epoch (a create_revision never goes back: the epoch is gone for good)."""
        out = {}
        for shard, epoch in fence.items():
            kv = found.get(self.election.leader_key(shard))
            if kv is None or kv.create_revision != epoch:
                out[shard] = epoch
        return out

    def _fence(self, epoch: int, shard: int = 0) -> Fenced:
        self.metrics.fenced.inc()
        if self.election.epoch_of(shard) == epoch:  # not if we already lead again under a newer epoch
            self.election.step_down(f"epoch {epoch} fenced by etcd", shard)
            self.invalidate(None if self.election.shards == 1 else shard)
        return Fenced(f"this replica's epoch {epoch} is no longer current; nothing was granted",
                      extra={"epoch": epoch} if self.election.shards == 1 else {"epoch": epoch, "shard": shard})

    def _fence_deposed(self, items: list[_Item], fence: dict[int, int], found: dict[bytes, KV]) -> list[_Item]:
        """Answer the items of deposed shards ``Fenced``; the others."""
        deposed = self._deposed(fence, found)
        for shard, epoch in deposed.items():
            fenced = self._fence(epoch, shard)
            for it in items:
                if it.shard == shard:
                    self._answer(it, error=fenced)
        return [it for it in items if it.shard not in deposed]

    # -- window state ---------------------------------------------------------------------------
    async def _load_windows(self, wanted: set[tuple[str, int]]) -> None:
        missing = [wk for wk in wanted if wk not in self._cache]
        if not missing:
            return
        keys = [self.keys.window(*wk) for wk in missing]
        found = await self.store.get_many(keys)
        for wk, key in zip(missing, keys, strict=True):
            self._cache[wk] = self._cached_from(wk, key, found.get(key))

    def _cached_from(self, wk: tuple[str, int], key: bytes, kv: KV | None) -> _Cached:
        if kv is None:
            return _Cached(policy.new_window(self.pools[wk[0]], wk[1]), 0, key)
        return _Cached(msgspec.json.decode(kv.value, type=policy.WindowState), kv.mod_revision, key)

    def _drop(self, wks: Any) -> None:
        """Forget windows a unit decided on but did not commit (their state in memory is ahead)."""
        for wk in wks:
            self._cache.pop(wk, None)

    def _record_lease_expiry(self, pool: Pool, index: int) -> int:
        return (index + 1) * pool.window_ms + max(pool.window_ms, RECORD_MIN_LINGER_MS)

    async def _window_leases(self, windows: dict[tuple[str, int], _Cached], now: int) -> None:
        """One shared etcd lease per window's records (an expiry bucket), kept on the cached
        window until the buckets are forgotten: rarely a call."""
        gen = self._buckets.generation
        for wk, c in windows.items():
            if c.lease_gen != gen:
                expiry = self._record_lease_expiry(self.pools[wk[0]], wk[1])
                lid = self._buckets.cached(expiry, now)
                c.lease = lid if lid is not None else await self._buckets.lease_for(expiry, now)
                c.lease_gen = gen

    def _put_window(self, txn: TxnBuilder, wk: tuple[str, int], cached: _Cached) -> None:
        raw = self._encode(cached.state)
        self._window_bytes[wk[0]] = len(raw) + 2 * len(cached.key)
        txn.put(cached.key, raw, cached.lease)

    # -- grants ---------------------------------------------------------------------------------
    async def _commit_grants(self, items: list[_Item], held: set[tuple[str, int]]) -> None:
        pending = items
        for attempt in range(self.max_attempts):
            now = self.clock()
            targets: list[tuple[_Item, Pool, tuple[str, int]]] = []
            for it in pending:
                try:
                    pool = self.pool(it.pool)  # the pool may have left the bundle since
                    targets.append((it, pool, (pool.id, policy.target_window(pool, it.req.window, now))))
                except LeaseholdError as e:
                    self._answer(it, error=e)
            if not targets:
                return
            pending = [t[0] for t in targets]
            wks = {t[2] for t in targets}
            held |= wks
            self._held |= wks
            # the window before each one, read only: the regions' spend history (demand caps; its
            # ``spent`` changes only with usage reports, which never share a unit with grants)
            await self._load_windows(wks | {(p, k - 1) for p, k in wks})
            windows = {wk: self._cache[wk] for wk in wks}
            before = {wk: self._cache.get((wk[0], wk[1] - 1)) for wk in wks}
            await self._window_leases(windows, now)
            # No local leadership check here: each item carries the epoch its shard was accepted under
            # and etcd decides (the txn compares it). A leader resumed after a pause gets Fenced.
            fence = {it.shard: it.epoch for it in pending}  # one epoch per shard in a unit (grouping)
            txn = TxnBuilder()
            self._fence_compares(txn, fence)
            for c in windows.values():
                if c.mod_revision:
                    txn.modified_at(c.key, c.mod_revision)
                else:
                    txn.absent(c.key)
            answers: list[tuple[_Item, LeaseGrant, policy.GrantDecision]] = []
            absent: list[bytes] = []
            puts: list[tuple[bytes, bytes, int]] = []
            encode, grant_key = self._encode, self.keys.grant
            try:
                for it, pool, wk in targets:  # decided in place: the unit owns these windows
                    r = it.req
                    prev = before[wk]
                    try:
                        d = policy.decide_grant(pool, windows[wk].state, region=r.region, want=r.want,
                                                demand=r.demand, now_ms=now,
                                                previous=prev.state if prev is not None else None)
                    except LeaseholdError as e:  # e.g. the region left the pool in a new bundle
                        self._answer(it, error=e)
                        continue
                    g = LeaseGrant(lease_id=r.lease_id, pool=r.pool, region=r.region, granted=d.granted,
                                   window=d.window, expires_at_ms=d.expires_at_ms, ttl_ms=d.ttl_ms,
                                   starts_in_ms=d.starts_in_ms, epoch=it.epoch, issued_at_ms=now,
                                   remaining=d.remaining)
                    key = grant_key(r.region, r.lease_id)
                    absent.append(key)
                    puts.append((key, encode(GrantRecord(grant=g, demand=r.demand)), windows[wk].lease))
                    answers.append((it, g, d))
                if not answers:
                    self._drop(wks)
                    return
                txn.absent_many(absent)
                txn.put_many(puts)
                for wk, c in windows.items():
                    self._put_window(txn, wk, c)
            except BaseException:
                self._drop(wks)
                raise
            pending = [a[0] for a in answers]
            done = await self._commit_unit(txn, wks, pending, "grant", windows,
                                           partial(self._answer_grants, answers, windows, now))
            if done is None:
                continue
            if done:
                return
            # -- a compare failed: find out which (reads after it are as good to decide on: a
            # create_revision never goes back, and a grant record found is final) -----------------
            found = await self.store.get_many([*(self.election.leader_key(s) for s in fence),
                                               *(self.keys.window(*wk) for wk in wks),
                                               *(grant_key(it.req.region, it.req.lease_id) for it in pending)])
            pending = self._fence_deposed(pending, fence, found)
            for wk in wks:
                key = self.keys.window(*wk)
                self._cache[wk] = self._cached_from(wk, key, found.get(key))
            for it in list(pending):
                kv = found.get(grant_key(it.req.region, it.req.lease_id))
                if kv is not None:
                    pending.remove(it)
                    self._answer_replay(it, kv.value)
            if not pending:
                return
            self.metrics.txn_retries.labels("grant").inc()
            log.debug("grant txn conflict (attempt %d), retrying %d grants", attempt + 1, len(pending))
        raise Unavailable(f"lease grant not committed after {self.max_attempts} conflicting attempts; retry",
                          extra={"attempts": self.max_attempts})

    def _answer_replay(self, item: _Item, raw: bytes) -> None:
        rec = msgspec.json.decode(raw, type=GrantRecord)
        try:
            _check_same(rec.grant.pool, rec.grant.region, item.req)
        except Conflict as e:
            self._answer(item, error=e)
            return
        self.metrics.replays.labels(rec.grant.pool).inc()
        self._answer(item, policy.replay_view(rec.grant, self.clock()))

    def _answer_grants(self, answers: list[tuple[_Item, LeaseGrant, policy.GrantDecision]], windows: dict,
                       now: int) -> None:
        """A grant unit committed: answer its items, count them and its windows' fill."""
        self.metrics.txn_grants.observe(len(answers))
        for it, g, d in answers:
            self._count_grant(g, d)
            self._answer(it, g)
        for wk, c in windows.items():  # the window's fill after the unit's last decision
            pool = self.pools.get(wk[0])
            if pool is not None:
                self.metrics.note_grant_window(wk[0], policy.window_ref(wk[1], pool.window_ms), pool.limit,
                                               c.state.remaining)
        self._prune_cache(now)

    def _count_grant(self, g: LeaseGrant, d: policy.GrantDecision) -> None:
        if g.granted:
            counts = self._granted.get((g.pool, g.region))
            if counts is None:
                if len(self._granted) >= 100_000:
                    self.flush_metrics()
                counts = self._granted[(g.pool, g.region)] = [0, 0]
            counts[0] += 1
            counts[1] += g.granted
        else:
            self.metrics.empty_grants.labels(g.pool, self.metrics.region(g.region)).inc()
        if d.exhausted_now:
            self.metrics.exhaustions.labels(g.pool).inc()

    def _prune_cache(self, now: int) -> None:
        """Forget windows that ended more than one window ago; count their unreported tokens.
        A scan of every cached window, so at most once per second (it dominated grant latency
        with 10,000 pools when it ran after every transaction)."""
        if now - self._last_prune_ms < 1_000:
            return
        self._last_prune_ms = now
        for wk in [wk for wk in self._cache
                   if wk[0] not in self.pools or (wk[1] + 2) * self.pools[wk[0]].window_ms < now]:
            if wk in self._held:
                continue  # a unit in flight decides on it
            cached = self._cache.pop(wk)
            if cached.mod_revision:
                for region, tokens in policy.unreported_tokens(cached.state).items():
                    self.metrics.unreported_tokens.labels(wk[0], self.metrics.region(region)).inc(tokens)

    # -- usage reports --------------------------------------------------------------------------
    def _answer_receipts(self, receipts: list[tuple[_Item, GrantRecord]]) -> None:
        """A usage unit committed: answer its items, count the tokens returned and stranded."""
        for it, new in receipts:
            pool, region = new.grant.pool, self.metrics.region(new.grant.region)
            if new.returned:
                self.metrics.reclaimed_tokens.labels(pool, region).inc(new.returned)
            if new.stranded:
                self.metrics.stranded_tokens.labels(pool, region).inc(new.stranded)
            self._answer(it, _receipt(new, replayed=False))

    async def _commit_reports(self, items: list[_Item], held: set[tuple[str, int]]) -> None:
        """Reports of one unit: one read of their grant records, one transaction (fenced like a
        grant; each record's mod_revision as read, each window's) for all of them."""
        pending = items
        for _attempt in range(self.max_attempts):
            keys = [self.keys.grant(it.req.region, it.req.lease_id) for it in pending]
            found = await self.store.get_many(keys)
            now = self.clock()
            todo: list[tuple[_Item, bytes, KV, GrantRecord, policy.ReclaimDecision]] = []
            for it, key in zip(pending, keys, strict=True):
                rep: UsageReport = it.req
                kv = found.get(key)
                if kv is None:
                    self._answer(it, error=NotFound(f"no lease {rep.lease_id!r} for region {rep.region!r}"))
                    continue
                rec = msgspec.json.decode(kv.value, type=GrantRecord)
                if rec.grant.pool != rep.pool:  # the region's own lease: naming its pool tells it nothing new
                    self._answer(it, error=Conflict(f"lease {rep.lease_id!r} belongs to pool {rec.grant.pool!r}, "
                                                    f"not {rep.pool!r}"))
                    continue
                if rec.reported:
                    self._answer(it, _receipt(rec, replayed=True))
                    continue
                try:
                    d = policy.decide_reclaim(granted=rec.grant.granted, spent=rep.spent,
                                              expires_at_ms=rec.grant.expires_at_ms,
                                              window_end_ms=rec.grant.window.end_ms, now_ms=now,
                                              closed_early=rep.closed_early)
                except LeaseholdError as e:
                    self._answer(it, error=e)
                    continue
                todo.append((it, key, kv, rec, d))
            if not todo:
                return
            pending = [t[0] for t in todo]
            wks = {(rec.grant.pool, rec.grant.window.index) for _, _, _, rec, _ in todo if rec.grant.granted > 0}
            held |= wks
            self._held |= wks
            await self._load_windows(wks)
            # a window's key may be gone (expired): nothing is returned to it
            windows = {wk: self._cache[wk] for wk in wks if self._cache[wk].mod_revision}
            await self._window_leases(windows, now)
            fence = {it.shard: it.epoch for it in pending}
            txn = TxnBuilder()
            self._fence_compares(txn, fence)
            for c in windows.values():
                txn.modified_at(c.key, c.mod_revision)
            receipts: list[tuple[_Item, GrantRecord]] = []
            try:
                for it, key, kv, rec, d in todo:
                    rep = it.req
                    returned, stranded = d.returned, d.stranded
                    wk = (rec.grant.pool, rec.grant.window.index)
                    if rec.grant.granted > 0:
                        if wk in windows:
                            policy.apply_reclaim(windows[wk].state, rep.region, returned, rec.grant.granted,
                                                 rep.spent)
                        else:  # the window's key is gone: nothing to return to
                            returned, stranded = 0, d.returned + d.stranded
                    new = msgspec.structs.replace(rec, reported=True, spent=rep.spent, returned=returned,
                                                  stranded=stranded, window_open=d.window_open)
                    txn.modified_at(key, kv.mod_revision)
                    txn.put(key, self._encode(new), kv.lease)
                    receipts.append((it, new))
                for wk, c in windows.items():
                    self._put_window(txn, wk, c)
            except BaseException:
                self._drop(wks)
                raise
            done = await self._commit_unit(txn, wks, pending, "usage", windows, partial(self._answer_receipts, receipts))
            if done is None:
                continue
            if done:
                return
            found = await self.store.get_many([self.election.leader_key(s) for s in fence])
            pending = self._fence_deposed(pending, fence, found)
            if not pending:
                return
            self.metrics.txn_retries.labels("usage").inc()
        raise Unavailable(f"usage report not committed after {self.max_attempts} conflicting attempts; retry")


def _lease_error(lease_id: str, e: LeaseholdError) -> LeaseError:
    return LeaseError(lease_id=lease_id, status=e.status, code=e.code, detail=e.detail)


def _receipt(rec: GrantRecord, *, replayed: bool) -> UsageReceipt:
    return UsageReceipt(lease_id=rec.grant.lease_id, granted=rec.grant.granted, spent=rec.spent,
                        returned=rec.returned, window_open=rec.window_open, replayed=replayed)


def _check_same(pool: str, region: str, req: LeaseRequest) -> None:
    if pool != req.pool or region != req.region:
        # ``region`` is the caller's own (lease ids are per region): nothing about other regions
        raise Conflict(f"lease id {req.lease_id!r} is already used for pool {pool!r}", extra={"leaseId": req.lease_id})
