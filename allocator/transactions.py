"""One etcd transaction per unit of queued writes, tried until it commits: one loop, two strategies
(:class:`GrantStrategy` for grants, :class:`ReportStrategy` for usage reports).

Every attempt of the loop (:meth:`TransactionLoop.run_unit`):

1. the strategy *prepares* what is still pending: reads what it needs (a report its grant
   records), loads the windows it decides on into the window cache (:mod:`allocator.window_cache`)
   and holds them;
2. a transaction is built: ``create_revision(leader key of the shard) == epoch`` for every shard
   it writes (**fencing**: a deposed or paused leader cannot commit; :meth:`TransactionLoop._fence`),
   each window's ``mod_revision`` (or ``version == 0`` when new), then the strategy's compares and
   writes — decided *in place* on the cached windows — then the windows;
3. it is committed: on success the windows are cached at the commit's revision and the
   strategy answers its items; a lost etcd lease (of the records' expiry bucket) builds again;
   a transaction etcd refuses for its size goes back to the queue in smaller units;
4. a failed compare: the windows are dropped from the cache and the leader keys read back
   (with what the strategy wants re-checked): a changed epoch fences that shard's items
   (``Fenced``, 503, the election steps down from the shard), the rest is tried again (at most
   ``max_attempts``, then a retriable 503).

Nothing is granted from memory alone: an answer is returned only after its transaction
committed. The grant strategy compares each new grant key's ``version == 0`` (idempotency: a
stored record is never overwritten; one found after a conflict is answered as a replay); the
report strategy compares each grant record's ``mod_revision`` as read (a record reported
meanwhile replays its receipt at the next attempt).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

import msgspec

from kernel.bundle import Pool
from kernel.errors import Conflict, Fenced, LeaseholdError, NotFound, Unavailable
from kernel.etcd_store import KV, EtcdLeaseMissing, EtcdStore, EtcdTxnTooLarge, TxnBuilder
from kernel.wire import LeaseGrant, LeaseRequest, UsageReceipt, UsageReport

from . import allocation
from .committer import Committer, Item
from .grouping import Unit
from .metrics import AllocatorMetrics
from .records import GrantRecord, Keys
from .window_cache import CachedWindow, WindowCache, WindowKey

log = logging.getLogger(__name__)


class Leadership(Protocol):
    """What the writer needs of its election (:class:`allocator.election.Election`)."""

    shards: int

    def shard_of(self, pool: str) -> int: ...

    def leader_key(self, shard: int) -> bytes: ...

    def require_leader(self, shard: int = 0) -> int: ...  # the shard's epoch, or NotLeader naming its leader

    def epoch_of(self, shard: int) -> int | None: ...

    def step_down(self, reason: str, shard: int | None = None) -> None: ...


class Attempt:
    """One try of a unit: the items in it, the windows it decides on, the epochs it fences with."""

    def __init__(self, items: list[Item], now: int, wks: set[WindowKey], windows: dict[WindowKey, CachedWindow]):
        self.items = items
        self.now = now
        self.wks = wks  # every window held (decided on, or read for a rule)
        self.windows = windows  # the windows the transaction compares and writes
        self.fence = {it.shard: it.epoch for it in items}  # one epoch per shard in a unit (grouping)


A = TypeVar("A", bound=Attempt)
H = Callable[[set[WindowKey]], None]  # hold: keep windows from being pruned while a unit decides on them


class Strategy(Protocol, Generic[A]):
    kind: str  # the metrics label: "grant" or "usage"

    async def prepare(self, pending: list[Item], hold: H) -> A | None: ...

    def build(self, a: A, txn: TxnBuilder) -> bool: ...  # False: nothing left to commit

    def committed(self, a: A) -> None: ...

    def recheck(self, a: A) -> list[bytes]: ...  # keys read back after a failed compare

    def after_conflict(self, a: A, pending: list[Item], found: dict[bytes, KV]) -> list[Item]: ...

    def exhausted(self, attempts: int) -> LeaseholdError: ...


class GrantAttempt(Attempt):
    def __init__(self, targets: list[tuple[Item, WindowKey]], now: int, windows: dict[WindowKey, CachedWindow]):
        super().__init__([it for it, _ in targets], now, set(windows), windows)
        self.targets = targets
        self.answers: list[tuple[Item, LeaseGrant, allocation.GrantDecision]] = []


class ReportAttempt(Attempt):
    def __init__(self, todo: list[tuple[Item, KV, GrantRecord, allocation.ReclaimDecision]], now: int,
                 wks: set[WindowKey], windows: dict[WindowKey, CachedWindow]):
        super().__init__([t[0] for t in todo], now, wks, windows)
        self.todo = todo
        self.receipts: list[tuple[Item, GrantRecord]] = []


class TransactionLoop:
    def __init__(self, store: EtcdStore, keys: Keys, election: Leadership, cache: WindowCache, committer: Committer,
                 metrics: AllocatorMetrics, *, pools: Callable[[], Mapping[str, Pool]], clock: Callable[[], int],
                 max_attempts: int = 5):
        self.store = store
        self.keys = keys
        self.election = election
        self.cache = cache
        self.committer = committer
        self.metrics = metrics
        self.max_attempts = max_attempts
        self._encode = msgspec.json.Encoder().encode
        self.grants = GrantStrategy(self, pools, clock)
        self.reports = ReportStrategy(self, clock)

    def answer(self, item: Item, result: object = None, error: LeaseholdError | None = None) -> None:
        self.committer.answer(item, result, error)

    def encode(self, record: object) -> bytes:
        return self._encode(record)

    async def run_unit(self, unit: Unit[Item]) -> None:
        """Commit one unit; every item is answered when this returns."""
        items: list[Item] = unit.items
        held: set[WindowKey] = set()

        def hold(wks: set[WindowKey]) -> None:
            held.update(wks)
            self.cache.hold(wks)

        try:
            if unit.is_grant:
                await self._run(self.grants, items, hold)
            else:
                await self._run(self.reports, items, hold)
        except asyncio.CancelledError:
            for it in items:
                self.answer(it, error=Unavailable("allocator shutting down"))
            raise
        except LeaseholdError as e:
            for it in items:
                self.answer(it, error=e)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the committer
            log.exception("committer error")
            for it in items:
                self.answer(it, error=Unavailable(f"internal allocator error ({type(e).__name__})"))
        finally:
            self.cache.release(held)

    async def _run(self, strategy: Strategy[A], items: list[Item], hold: H) -> None:
        pending = items
        for attempt in range(self.max_attempts):
            a = await strategy.prepare(pending, hold)
            if a is None:
                return
            txn = TxnBuilder()
            for shard, epoch in a.fence.items():
                txn.created_at(self.election.leader_key(shard), epoch)
            txn.as_read((c.key, c.mod_revision) for c in a.windows.values())
            try:
                if not strategy.build(a, txn):
                    self.cache.drop(a.wks)
                    return
                encode, sizes, puts = self._encode, self.committer.window_bytes, []
                for wk, c in a.windows.items():
                    raw = encode(c.state)
                    sizes[wk[0]] = len(raw) + 2 * len(c.key)  # how much room its next units leave
                    puts.append((c.key, raw, c.etcd_lease))
                txn.put_many(puts)
            except BaseException:
                self.cache.drop(a.wks)
                raise
            done = await self._commit(txn, a, strategy)
            if done is None:
                continue
            if done:
                return
            # a compare failed: find out which (reads after it are as good to decide on: a
            # create_revision never goes back, and a grant record found is final)
            found = await self.store.get_many([*(self.election.leader_key(s) for s in a.fence), *strategy.recheck(a)])
            pending = strategy.after_conflict(a, self._fence(a.items, a.fence, found), found)
            if not pending:
                return
            self.metrics.txn_retries.labels(strategy.kind).inc()
            log.debug("%s txn conflict (attempt %d), retrying %d items", strategy.kind, attempt + 1, len(pending))
        raise strategy.exhausted(self.max_attempts)

    async def _commit(self, txn: TxnBuilder, a: A, strategy: Strategy[A]) -> bool | None:
        """True: done — committed (windows cached, items answered), or refused for its size and
        queued again split; None: the records' etcd lease was lost (build again); False: a
        compare failed (the windows dropped, counted): find out which."""
        try:
            res = await self.store.commit(txn, scope="grants")  # (grants and usage reports)
        except EtcdLeaseMissing:
            self.cache.drop(a.wks)
            self.cache.expiry_leases.forget()
            self.metrics.txn_retries.labels(strategy.kind).inc()
            return None
        except EtcdTxnTooLarge as e:
            self.cache.drop(a.wks)
            if len(a.items) == 1:
                raise
            if e.bytes_limit:  # for its op count the store lowered its limit already
                self.committer.lower_txn_bytes(txn.request.ByteSize())
            self.committer.requeue(a.items)
            return True
        except BaseException:
            self.cache.drop(a.wks)  # the outcome may be unknown: read again before the next use
            raise
        if res.succeeded:
            self.cache.committed(a.windows, res.revision)
            strategy.committed(a)
            return True
        self.cache.drop(a.wks)
        self.metrics.txn_conflicts.labels(strategy.kind).inc()
        return False

    # -- fencing: the one place a write is tied to its shard's epoch ----------------------------
    def _fence(self, items: list[Item], fence: dict[int, int], found: dict[bytes, KV]) -> list[Item]:
        """After a failed compare: answer ``Fenced`` the items of each shard whose leader key no
        longer carries the epoch they were accepted under (a create_revision never goes back:
        that epoch is gone for good); the others."""
        deposed: set[int] = set()
        for shard, epoch in fence.items():
            kv = found.get(self.election.leader_key(shard))
            if kv is not None and kv.create_revision == epoch:
                continue
            deposed.add(shard)
            self.metrics.fenced.inc()
            if self.election.epoch_of(shard) == epoch:  # not if we already lead again under a newer epoch
                self.election.step_down(f"epoch {epoch} fenced by etcd", shard)
            fenced = Fenced(f"this replica's epoch {epoch} is no longer current; nothing was granted",
                            extra={"epoch": epoch} if self.election.shards == 1 else {"epoch": epoch, "shard": shard})
            for it in items:
                if it.shard == shard:
                    self.answer(it, error=fenced)
        return [it for it in items if it.shard not in deposed]


class GrantStrategy:
    """Grants: each decided on its target window (with the window before it read for the demand
    cap), a new grant record per grant (``version == 0``), replays found after a conflict."""

    kind = "grant"

    def __init__(self, loop: TransactionLoop, pools: Callable[[], Mapping[str, Pool]], clock: Callable[[], int]):
        self.loop = loop
        self._pools = pools
        self.clock = clock

    async def prepare(self, pending: list[Item], hold: H) -> GrantAttempt | None:
        now = self.clock()
        pools = self._pools()
        targets: list[tuple[Item, WindowKey]] = []
        for it in pending:
            try:
                pool = lookup_pool(pools, it.pool)  # the pool may have left the bundle since
            except LeaseholdError as e:
                self.loop.answer(it, error=e)
                continue
            targets.append((it, (pool.id, allocation.target_window(pool, it.req.window, now))))
        if not targets:
            return None
        epochs = {wk: it.epoch for it, wk in targets}  # a unit holds one epoch per shard, so per pool
        hold(set(epochs))
        # the window before each one, read only: the regions' spend history (demand caps; its
        # ``spent`` changes only with usage reports, which never share a unit with grants)
        await self.loop.cache.load({**{(p, k - 1): e for (p, k), e in epochs.items()}, **epochs})
        windows = {wk: self.loop.cache.get(wk) for wk in epochs}
        await self.loop.cache.attach_leases(windows, now)
        return GrantAttempt(targets, now, windows)

    def build(self, a: GrantAttempt, txn: TxnBuilder) -> bool:
        pools, peek, grant_key = self._pools(), self.loop.cache.peek, self.loop.keys.grant
        decide, encode, windows, now = allocation.decide_grant, self.loop.encode, a.windows, a.now
        absent: list[bytes] = []
        puts: list[tuple[bytes, bytes, int]] = []
        answers = a.answers
        for it, wk in a.targets:  # decided in place: the unit owns these windows
            r: LeaseRequest = it.req
            window = windows[wk]
            prev = peek((wk[0], wk[1] - 1), it.epoch)
            try:
                d = decide(lookup_pool(pools, it.pool), window.state, region=r.region, want=r.want, demand=r.demand,
                           now_ms=now, previous=prev.state if prev is not None else None)
            except LeaseholdError as e:  # e.g. the region left the pool in a new bundle
                self.loop.answer(it, error=e)
                continue
            g = LeaseGrant(lease_id=r.lease_id, pool=r.pool, region=r.region, granted=d.granted, window=d.window,
                           expires_at_ms=d.expires_at_ms, ttl_ms=d.ttl_ms, starts_in_ms=d.starts_in_ms,
                           epoch=it.epoch, issued_at_ms=now, remaining=d.remaining)
            key = grant_key(r.region, r.lease_id)
            absent.append(key)
            puts.append((key, encode(GrantRecord(grant=g, demand=r.demand, want=r.want, requested_window=r.window)),
                         window.etcd_lease))
            answers.append((it, g, d))
        a.items = [it for it, _, _ in a.answers]
        if not a.answers:
            return False
        txn.absent_many(absent)
        txn.put_many(puts)
        return True

    def committed(self, a: GrantAttempt) -> None:
        """Answer the unit's grants, count them and the windows' fill."""
        m = self.loop.metrics
        m.txn_grants.observe(len(a.answers))
        count, answer = m.count_grant, self.loop.committer.answer
        for it, g, d in a.answers:
            count(g.pool, g.region, g.granted, d.exhausted_now)
            answer(it, g)
        pools, note = self._pools(), m.window_fill.note
        for (pool_id, k), c in a.windows.items():  # the window's fill after the unit's last decision
            pool = pools.get(pool_id)
            if pool is not None:
                w = pool.window_ms
                note(pool_id, k, k * w, (k + 1) * w, pool.limit, c.state.remaining)
        self.loop.cache.prune(a.now)

    def recheck(self, a: GrantAttempt) -> list[bytes]:
        keys = self.loop.keys
        return [*(keys.window(*wk) for wk in a.windows), *(keys.grant(it.req.region, it.req.lease_id) for it in a.items)]

    def after_conflict(self, a: GrantAttempt, pending: list[Item], found: dict[bytes, KV]) -> list[Item]:
        """The windows as read back go to the cache; a grant record found is a replay."""
        keys = self.loop.keys
        epochs = {wk: it.epoch for it, wk in a.targets}
        for wk in a.windows:
            key = keys.window(*wk)
            self.loop.cache.put_read(wk, key, found.get(key), epochs[wk])
        left = []
        for it in pending:
            kv = found.get(keys.grant(it.req.region, it.req.lease_id))
            if kv is None:
                left.append(it)
            else:
                self.replay(it, kv.value)
        return left

    def replay(self, item: Item, raw: bytes) -> None:
        rec = msgspec.json.decode(raw, type=GrantRecord)
        try:
            check_same(item.req, pool=rec.grant.pool, region=rec.grant.region, want=rec.want, demand=rec.demand,
                       window=rec.requested_window)
        except Conflict as e:
            self.loop.answer(item, error=e)
            return
        self.loop.metrics.replays.labels(rec.grant.pool).inc()
        self.loop.answer(item, allocation.replay_view(rec.grant, self.clock()))

    def exhausted(self, attempts: int) -> LeaseholdError:
        return Unavailable(f"lease grant not committed after {attempts} conflicting attempts; retry",
                           extra={"attempts": attempts})


class ReportStrategy:
    """Usage reports: one read of the unit's grant records, each reclaim decided exactly as a
    single report (the region's own lease namespace, ``closedEarly``, spend history), the
    records rewritten comparing their ``mod_revision`` as read."""

    kind = "usage"

    def __init__(self, loop: TransactionLoop, clock: Callable[[], int]):
        self.loop = loop
        self.clock = clock

    async def prepare(self, pending: list[Item], hold: H) -> ReportAttempt | None:
        keys = [self.loop.keys.grant(it.req.region, it.req.lease_id) for it in pending]
        found = await self.loop.store.get_many(keys)
        now = self.clock()
        todo: list[tuple[Item, KV, GrantRecord, allocation.ReclaimDecision]] = []
        for it, key in zip(pending, keys, strict=True):
            rep: UsageReport = it.req
            kv = found.get(key)
            if kv is None:
                self.loop.answer(it, error=NotFound(f"no lease {rep.lease_id!r} for region {rep.region!r}"))
                continue
            rec = msgspec.json.decode(kv.value, type=GrantRecord)
            if rec.grant.pool != rep.pool:  # the region's own lease: naming its pool tells it nothing new
                self.loop.answer(it, error=Conflict(f"lease {rep.lease_id!r} belongs to pool {rec.grant.pool!r}, "
                                                    f"not {rep.pool!r}"))
                continue
            if rec.reported:
                self.loop.answer(it, receipt(rec, replayed=True))
                continue
            try:
                d = allocation.decide_reclaim(granted=rec.grant.granted, spent=rep.spent,
                                              expires_at_ms=rec.grant.expires_at_ms,
                                              window_end_ms=rec.grant.window.end_ms, now_ms=now,
                                              closed_early=rep.closed_early)
            except LeaseholdError as e:
                self.loop.answer(it, error=e)
                continue
            todo.append((it, kv, rec, d))
        if not todo:
            return None
        epochs = {(rec.grant.pool, rec.grant.window.index): it.epoch for it, _, rec, _ in todo if rec.grant.granted > 0}
        hold(set(epochs))
        await self.loop.cache.load(epochs)
        # a window's key may be gone (expired): nothing is returned to it
        windows = {wk: c for wk in epochs if (c := self.loop.cache.get(wk)).mod_revision}
        await self.loop.cache.attach_leases(windows, now)
        return ReportAttempt(todo, now, set(epochs), windows)

    def build(self, a: ReportAttempt, txn: TxnBuilder) -> bool:
        for it, kv, rec, d in a.todo:
            rep: UsageReport = it.req
            returned, stranded = d.returned, d.stranded
            wk = (rec.grant.pool, rec.grant.window.index)
            if rec.grant.granted > 0:
                if wk in a.windows:
                    allocation.apply_reclaim(a.windows[wk].state, rep.region, returned, rec.grant.granted, rep.spent)
                else:  # the window's key is gone: nothing to return to
                    returned, stranded = 0, d.returned + d.stranded
            new = msgspec.structs.replace(rec, reported=True, spent=rep.spent, returned=returned, stranded=stranded,
                                          window_open=d.window_open)
            txn.modified_at(kv.key, kv.mod_revision)
            txn.put(kv.key, self.loop.encode(new), kv.lease)
            a.receipts.append((it, new))
        return True

    def committed(self, a: ReportAttempt) -> None:
        """Answer the unit's reports, count the tokens returned and stranded."""
        m = self.loop.metrics
        for it, new in a.receipts:
            pool, region = new.grant.pool, m.region(new.grant.region)
            if new.returned:
                m.reclaimed_tokens.labels(pool, region).inc(new.returned)
            if new.stranded:
                m.stranded_tokens.labels(pool, region).inc(new.stranded)
            self.loop.answer(it, receipt(new, replayed=False))

    def recheck(self, a: ReportAttempt) -> list[bytes]:
        return []  # the records are read again by the next attempt

    def after_conflict(self, a: ReportAttempt, pending: list[Item], found: dict[bytes, KV]) -> list[Item]:
        return pending

    def exhausted(self, attempts: int) -> LeaseholdError:
        return Unavailable(f"usage report not committed after {attempts} conflicting attempts; retry")


def lookup_pool(pools: Mapping[str, Pool], pool_id: str) -> Pool:
    pool = pools.get(pool_id)
    if pool is None:
        shown = pool_id if len(pool_id) <= 64 else pool_id[:64] + "..."  # the caller's text, bounded
        raise NotFound(f"no pool {shown!r} (known: {', '.join(sorted(pools)) or 'none'})")
    return pool


def receipt(rec: GrantRecord, *, replayed: bool) -> UsageReceipt:
    return UsageReceipt(lease_id=rec.grant.lease_id, granted=rec.grant.granted, spent=rec.spent,
                        returned=rec.returned, window_open=rec.window_open, replayed=replayed)


def check_same(req: LeaseRequest, *, pool: str, region: str, want: int, demand: int,
               window: str | None) -> None:
    """A retry of a lease id must repeat its first request (docs/invariants.md I17): another pool,
    ``want``, ``demand`` or ``window`` is a 409 (``want`` 0 / ``window`` None: a record that did not
    keep them, compared on the rest)."""
    differs = [name for name, first, again in (("pool", pool, req.pool), ("region", region, req.region),
                                               ("want", want or req.want, req.want), ("demand", demand, req.demand),
                                               ("window", window or req.window, req.window)) if first != again]
    if differs:
        # ``region`` is the caller's own (lease ids are per region): nothing about other regions
        raise Conflict(f"lease id {req.lease_id!r} is already used for another request "
                       f"({', '.join(differs)} differ{'s' if len(differs) == 1 else ''}): a retry repeats its "
                       "request, a new request takes a new lease id", extra={"leaseId": req.lease_id})
