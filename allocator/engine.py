"""The leader's single writer: queue, group commit, idempotency, fencing, reclaim.

Every write goes through one committer task. It keeps each active window's state in memory
(with the window key's ``mod_revision``), decides grants with :mod:`allocator.policy` and
commits a group of grants in one etcd transaction whose compares are

* ``create_revision(leader key of the pool's shard) == epoch`` for every shard the transaction
  writes (fencing: a deposed or paused leader cannot commit; one shard and the key ``leader``
  unless the deployment is sharded, see :mod:`allocator.shards`; built in :meth:`Engine._fence_compares`),
* each touched window key's ``mod_revision`` (or ``version == 0`` when new),
* each new grant key's ``version == 0`` (idempotency: a stored record is never overwritten).

On a failed compare the failure branch reads back the leader keys, the windows and the grant
keys: a changed epoch fences that shard's grants (nothing granted, step down from the shard),
existing grant records are answered as replays, changed windows are reloaded and the rest
retried (bounded). Nothing is ever granted from memory alone: an answer is returned only after
its transaction committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

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
    MAX_TXN_OPS,
    EtcdLeaseMissing,
    EtcdStore,
    LeaseBuckets,
    range_kvs,
    txn_revision,
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
from .metrics import AllocatorMetrics

log = logging.getLogger("allocator.engine")

MAX_GROUP = (MAX_TXN_OPS - 1) // 2  # grants per txn: 1 + windows + grants compares <= 128
RECORD_MIN_LINGER_MS = 60_000
TXNS_IN_FLIGHT = 4  # grant transactions the committer sends concurrently
MAX_QUEUE = 16_384  # queued writes; beyond this the leader sheds load with a retriable 503


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class GrantRecord(msgspec.Struct, rename="camel"):
    """What ``grants/<leaseId>`` holds: the grant as answered, plus its usage report."""

    grant: LeaseGrant
    demand: int = 0
    reported: bool = False
    spent: int = 0
    returned: int = 0
    stranded: int = 0
    window_open: bool = False


@dataclass
class _Cached:
    state: policy.WindowState
    mod_revision: int  # 0 = not in etcd yet


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
class _GrantJob:
    req: LeaseRequest
    fut: asyncio.Future[LeaseGrant]
    epoch: int  # the epoch this replica led the pool's shard with when it accepted the request
    shard: int = 0


@dataclass
class _UsageJob:
    report: UsageReport
    fut: asyncio.Future[UsageReceipt]
    epoch: int
    shard: int = 0


@dataclass
class Keys:
    prefix: str

    @property
    def leader(self) -> bytes:
        return f"{self.prefix}leader".encode()

    def window(self, pool: str, index: int) -> bytes:
        return f"{self.prefix}pools/{pool}/{index}".encode()

    def grant(self, lease_id: str) -> bytes:
        return f"{self.prefix}grants/{lease_id}".encode()

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
    max_group: int = MAX_GROUP
    max_attempts: int = 5

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self.max_group = max(1, min(self.max_group, MAX_GROUP))
        self._queue: asyncio.Queue[_GrantJob | _UsageJob] = asyncio.Queue()
        self._inflight: dict[str, _GrantJob] = {}
        self._cache: dict[tuple[str, int], _Cached] = {}
        self._last_prune_ms = 0  # wall ms of the last cache scan (_prune_cache)
        self._buckets = LeaseBuckets(self.store)
        self._task: asyncio.Task[None] | None = None
        self._grant_counters: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._open: dict[int, int] = {}  # shard -> accepted writes not answered yet (for a handoff's drain)
        self._idle: dict[int, asyncio.Event] = {}  # set when a drained shard's last write is answered

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._committer(), name="allocator-committer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.fut.done():
                _fail(job.fut, Unavailable("allocator shutting down"))

    def invalidate(self, shard: int | None = None) -> None:
        """Forget cached window state (of one shard's pools, or all) on a leadership change."""
        if shard is None:
            self._cache.clear()
            self._buckets.forget()
            return
        for wk in [wk for wk in self._cache if self.election.shard_of(wk[0]) == shard]:
            del self._cache[wk]

    async def drain(self, shard: int) -> None:
        """Wait until every write accepted for ``shard`` has been answered (a handoff calls this
        after it stopped accepting the shard, with its own time bound)."""
        while self._open.get(shard):
            await self._idle.setdefault(shard, asyncio.Event()).wait()

    def _track(self, shard: int, fut: asyncio.Future[Any]) -> None:
        self._open[shard] = self._open.get(shard, 0) + 1

        def done(_f: asyncio.Future[Any]) -> None:
            self._open[shard] -= 1
            if not self._open[shard] and (idle := self._idle.pop(shard, None)) is not None:
                idle.set()
        fut.add_done_callback(done)

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
        return await self._submit(req)

    async def grant_many(self, reqs: list[LeaseRequest]) -> list[LeaseGrant | LeaseError]:
        """Every item queued at once (the committer groups them into few transactions); one wait
        for all of them, no task per item. A cancelled caller leaves the shared futures alone."""
        futs: list[asyncio.Future[LeaseGrant] | LeaseError] = []
        for r in reqs:
            try:
                futs.append(self._enqueue(r))
            except LeaseholdError as e:
                futs.append(LeaseError(lease_id=r.lease_id, status=e.status, code=e.code, detail=e.detail))
        waiting = [f for f in futs if isinstance(f, asyncio.Future)]
        if waiting:
            await asyncio.wait(waiting)
        out: list[LeaseGrant | LeaseError] = []
        for r, f in zip(reqs, futs, strict=True):
            if not isinstance(f, asyncio.Future):
                out.append(f)
                continue
            exc = f.exception()
            if exc is None:
                out.append(f.result())
            elif isinstance(exc, LeaseholdError):
                out.append(LeaseError(lease_id=r.lease_id, status=exc.status, code=exc.code, detail=exc.detail))
            else:
                raise exc
        return out

    async def report(self, report: UsageReport) -> UsageReceipt:
        self.pool(report.pool)
        shard = self.election.shard_of(report.pool)
        epoch = self.election.require_leader(shard)
        self._check_backlog()
        fut: asyncio.Future[UsageReceipt] = asyncio.get_running_loop().create_future()
        self._track(shard, fut)
        self._queue.put_nowait(_UsageJob(report, fut, epoch, shard))
        return await fut

    async def get_record(self, lease_id: str) -> GrantRecord:
        kv = await self.store.get(self.keys.grant(lease_id))
        if kv is None:
            raise NotFound(f"no lease {lease_id!r}")
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
    async def _submit(self, req: LeaseRequest) -> LeaseGrant:
        return await asyncio.shield(self._enqueue(req))

    def _enqueue(self, req: LeaseRequest) -> asyncio.Future[LeaseGrant]:
        """Queue a grant for the committer (or join the one in flight for the same lease id);
        the future is shared, so callers must not cancel it."""
        pool = self.pool(req.pool)
        policy.check_region(pool, req.region)
        existing = self._inflight.get(req.lease_id)
        if existing is not None:
            _check_same(existing.req.pool, existing.req.region, req)
            return existing.fut
        shard = self.election.shard_of(req.pool)
        epoch = self.election.require_leader(shard)
        self._check_backlog()
        fut: asyncio.Future[LeaseGrant] = asyncio.get_running_loop().create_future()
        job = _GrantJob(req, fut, epoch, shard)
        self._inflight[req.lease_id] = job
        fut.add_done_callback(lambda _f: self._inflight.pop(req.lease_id, None))
        self._track(shard, fut)
        self._queue.put_nowait(job)
        return fut

    def _check_backlog(self) -> None:
        if self._queue.qsize() >= MAX_QUEUE:
            raise Unavailable(f"allocator leader overloaded ({MAX_QUEUE} writes queued); retry shortly")

    # -- committer ------------------------------------------------------------------------------
    async def _committer(self) -> None:
        while True:
            first = await self._queue.get()
            jobs: list[_GrantJob | _UsageJob] = [first]
            while not self._queue.empty() and len(jobs) < 8 * self.max_group:
                jobs.append(self._queue.get_nowait())
            grants = [j for j in jobs if isinstance(j, _GrantJob)]
            usages = [j for j in jobs if isinstance(j, _UsageJob)]
            for generation in epoch_generations(grants):  # one epoch per shard and transaction
                waves = pool_disjoint_groups(generation, self.max_group, TXNS_IN_FLIGHT, shard_of=_job_shard)
                for wave in waves:
                    # a few transactions in flight, on disjoint pools: Python builds the next while
                    # etcd commits one. (Were two to touch one window, only one could commit: each
                    # compares the window's revision, the other reloads and retries.)
                    await asyncio.gather(*(self._run_guarded(g, self._commit_grants) for g in wave))
            for u in usages:
                await self._run_guarded([u], self._commit_usage)

    async def _run_guarded(self, jobs: list[Any], fn: Callable[[Any], Any]) -> None:
        try:
            await fn(jobs)
        except asyncio.CancelledError:
            for j in jobs:
                if not j.fut.done():
                    _fail(j.fut, Unavailable("allocator shutting down"))
            raise
        except LeaseholdError as e:
            for j in jobs:
                if not j.fut.done():
                    _fail(j.fut, e)
        except Exception as e:  # noqa: BLE001 - a bug must not kill the committer
            log.exception("committer error")
            for j in jobs:
                if not j.fut.done():
                    _fail(j.fut, Unavailable(f"internal allocator error ({type(e).__name__})"))

    # -- fencing: the one place a write is tied to its shard's epoch ----------------------------
    def _fence_compares(self, fence: dict[int, int]) -> list[Any]:
        """``create_revision(leader key of shard) == epoch`` for each shard -> epoch a transaction
        writes: etcd refuses the whole transaction if any of them was deposed meanwhile."""
        t = self.store.t
        return [t.create(self.election.leader_key(shard)) == epoch for shard, epoch in fence.items()]

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

    async def _load_windows(self, wanted: set[tuple[str, int]]) -> None:
        missing = [wk for wk in wanted if wk not in self._cache]
        if not missing:
            return
        found = await self.store.get_many([self.keys.window(*wk) for wk in missing])
        for wk in missing:
            kv = found.get(self.keys.window(*wk))
            self._cache[wk] = (_Cached(policy.new_window(self.pools[wk[0]], wk[1]), 0) if kv is None else
                               _Cached(msgspec.json.decode(kv.value, type=policy.WindowState), kv.mod_revision))

    def _record_lease_expiry(self, pool: Pool, index: int) -> int:
        return (index + 1) * pool.window_ms + max(pool.window_ms, RECORD_MIN_LINGER_MS)

    async def _commit_grants(self, jobs: list[_GrantJob]) -> None:
        pending = list(jobs)
        for attempt in range(self.max_attempts):
            now = self.clock()
            targets: dict[int, tuple[str, int]] = {}
            for job in list(pending):
                try:
                    pool = self.pools[job.req.pool]
                    targets[id(job)] = (pool.id, policy.target_window(pool, job.req.window, now))
                except LeaseholdError as e:
                    _fail(job.fut, e)
                    pending.remove(job)
            if not pending:
                return
            await self._load_windows(set(targets.values()))
            work = {wk: self._cache[wk].state.copy() for wk in set(targets.values())}
            answers: list[tuple[_GrantJob, LeaseGrant, policy.GrantDecision]] = []
            for job in pending:
                r = job.req
                d = policy.decide_grant(self.pools[r.pool], work[targets[id(job)]], region=r.region, want=r.want,
                                        demand=r.demand, now_ms=now)
                g = LeaseGrant(lease_id=r.lease_id, pool=r.pool, region=r.region, granted=d.granted,
                               window=d.window, expires_at_ms=d.expires_at_ms, ttl_ms=d.ttl_ms,
                               starts_in_ms=d.starts_in_ms, epoch=job.epoch, issued_at_ms=now,
                               remaining=d.remaining)
                answers.append((job, g, d))
            wks = list(work)
            t = self.store.t
            # No local leadership check here: each job carries the epoch its shard was accepted under
            # and etcd decides (the txn compares it). A leader resumed after a pause gets Fenced.
            fence = {job.shard: job.epoch for job in pending}  # one epoch per shard in a group (committer)
            compare = self._fence_compares(fence)
            for wk in wks:
                rev = self._cache[wk].mod_revision
                compare.append(t.mod(self.keys.window(*wk)) == rev if rev else t.version(self.keys.window(*wk)) == 0)
            compare += [t.version(self.keys.grant(j.req.lease_id)) == 0 for j in pending]
            try:
                success = []
                lids: dict[tuple[str, int], int] = {}  # one etcd lease per window's records
                for wk in wks:
                    lid = lids[wk] = await self._buckets.lease_for(
                        self._record_lease_expiry(self.pools[wk[0]], wk[1]), now)
                    success.append(t.put(self.keys.window(*wk), msgspec.json.encode(work[wk]), lease=lid))
                encode = msgspec.json.encode
                for job, g, _ in answers:
                    success.append(t.put(self.keys.grant(job.req.lease_id),
                                         encode(GrantRecord(grant=g, demand=job.req.demand)),
                                         lease=lids[targets[id(job)]]))
                ok, responses = await self.store.txn(compare, success, [])
                if not ok:
                    # which compare failed: read the leader, the windows and the grant records now
                    # (building these reads into every transaction cost a third of its ops; a
                    # conflict is rare, and what is read after it is as good to decide on: a
                    # create_revision never goes back, and a grant record found is final)
                    found = await self.store.get_many([*(self.election.leader_key(s) for s in fence),
                                                       *(self.keys.window(*wk) for wk in wks),
                                                       *(self.keys.grant(j.req.lease_id) for j in pending)])
            except EtcdLeaseMissing:
                self._buckets.forget()
                self.metrics.txn_retries.labels("grant").inc()
                continue
            except LeaseholdError:
                for wk in wks:  # the outcome may be unknown: reload before the next use
                    self._cache.pop(wk, None)
                raise
            if ok:
                rev = txn_revision(responses)
                for wk in wks:
                    self._cache[wk] = _Cached(work[wk], rev)
                self.metrics.txn_grants.observe(len(answers))
                for job, g, d in answers:
                    self._count_grant(g, d)
                    _settle(job.fut, g)
                self._prune_cache(now)
                return
            # -- a compare failed: find out which --------------------------------------------------
            self.metrics.txn_conflicts.labels("grant").inc()
            deposed = self._deposed(fence, found)
            for shard, epoch in deposed.items():
                fenced = self._fence(epoch, shard)
                for job in pending:
                    if job.shard == shard:
                        _fail(job.fut, fenced)
            pending = [j for j in pending if j.shard not in deposed]
            for wk in wks:
                kv = found.get(self.keys.window(*wk))
                self._cache[wk] = (_Cached(msgspec.json.decode(kv.value, type=policy.WindowState), kv.mod_revision)
                                   if kv is not None else _Cached(policy.new_window(self.pools[wk[0]], wk[1]), 0))
            for job in list(pending):
                kv = found.get(self.keys.grant(job.req.lease_id))
                if kv is not None:
                    pending.remove(job)
                    self._answer_replay(job, kv.value)
            if not pending:
                return
            self.metrics.txn_retries.labels("grant").inc()
            log.info("grant txn conflict (attempt %d), retrying %d grants", attempt + 1, len(pending))
        raise Unavailable(f"lease grant not committed after {self.max_attempts} conflicting attempts; retry",
                          extra={"attempts": self.max_attempts})

    def _answer_replay(self, job: _GrantJob, raw: bytes) -> None:
        rec = msgspec.json.decode(raw, type=GrantRecord)
        try:
            _check_same(rec.grant.pool, rec.grant.region, job.req)
        except Conflict as e:
            _fail(job.fut, e)
            return
        self.metrics.replays.labels(rec.grant.pool).inc()
        _settle(job.fut, policy.replay_view(rec.grant, self.clock()))

    def _count_grant(self, g: LeaseGrant, d: policy.GrantDecision) -> None:
        if g.granted:
            children = self._grant_counters.get((g.pool, g.region))
            if children is None:  # labels() validates and locks: resolve once per (pool, region)
                region = self.metrics.region(g.region)
                if len(self._grant_counters) >= 100_000:
                    self._grant_counters.clear()
                children = self._grant_counters[(g.pool, g.region)] = (
                    self.metrics.grants.labels(g.pool, region), self.metrics.granted_tokens.labels(g.pool, region))
            children[0].inc()
            children[1].inc(g.granted)
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
                   if (wk[1] + 2) * self.pools[wk[0]].window_ms < now]:
            cached = self._cache.pop(wk)
            if cached.mod_revision:
                for region, tokens in policy.unreported_tokens(cached.state).items():
                    self.metrics.unreported_tokens.labels(wk[0], self.metrics.region(region)).inc(tokens)

    async def _commit_usage(self, jobs: list[_UsageJob]) -> None:
        (job,) = jobs
        rep = job.report
        pool = self.pool(rep.pool)
        for _attempt in range(self.max_attempts):
            epoch, shard = job.epoch, job.shard
            gkey = self.keys.grant(rep.lease_id)
            gkv = await self.store.get(gkey)
            if gkv is None:
                raise NotFound(f"no lease {rep.lease_id!r}")
            rec = msgspec.json.decode(gkv.value, type=GrantRecord)
            if rec.grant.pool != rep.pool or rec.grant.region != rep.region:
                raise Conflict(f"lease {rep.lease_id!r} belongs to pool {rec.grant.pool!r} region "
                               f"{rec.grant.region!r}, not pool {rep.pool!r} region {rep.region!r}")
            if rec.reported:
                _settle(job.fut, _receipt(rec, replayed=True))
                return
            now = self.clock()
            d = policy.decide_reclaim(granted=rec.grant.granted, spent=rep.spent,
                                      expires_at_ms=rec.grant.expires_at_ms,
                                      window_end_ms=rec.grant.window.end_ms, now_ms=now)
            wk = (pool.id, rec.grant.window.index)
            t = self.store.t
            compare = [*self._fence_compares({shard: epoch}), t.mod(gkey) == gkv.mod_revision]
            success = []
            new_state: policy.WindowState | None = None
            returned, stranded, window_open = d.returned, d.stranded, d.window_open
            if rec.grant.granted > 0:
                await self._load_windows({wk})
                cached = self._cache[wk]
                if cached.mod_revision == 0:  # the window's key is gone: nothing to return to
                    returned, stranded = 0, d.returned + d.stranded
                else:
                    new_state = cached.state.copy()
                    policy.apply_reclaim(new_state, rep.region, returned, rec.grant.granted)
                    lid = await self._buckets.lease_for(self._record_lease_expiry(pool, wk[1]), now)
                    compare.append(t.mod(self.keys.window(*wk)) == cached.mod_revision)
                    success.append(t.put(self.keys.window(*wk), msgspec.json.encode(new_state), lease=lid))
            new = msgspec.structs.replace(rec, reported=True, spent=rep.spent, returned=returned,
                                          stranded=stranded, window_open=window_open)
            success.append(t.put(gkey, msgspec.json.encode(new), lease=gkv.lease or None))
            try:
                ok, responses = await self.store.txn(compare, success, [t.get(self.election.leader_key(shard))])
            except EtcdLeaseMissing:
                self._buckets.forget()
                continue
            except LeaseholdError:
                self._cache.pop(wk, None)
                raise
            if ok:
                if new_state is not None:
                    self._cache[wk] = _Cached(new_state, txn_revision(responses))
                if returned:
                    self.metrics.reclaimed_tokens.labels(pool.id, self.metrics.region(rep.region)).inc(returned)
                if stranded:
                    self.metrics.stranded_tokens.labels(pool.id, self.metrics.region(rep.region)).inc(stranded)
                _settle(job.fut, _receipt(new, replayed=False))
                return
            self.metrics.txn_conflicts.labels("usage").inc()
            leader = range_kvs(responses[0])
            if not leader or leader[0].create_revision != epoch:
                raise self._fence(epoch, shard)
            self._cache.pop(wk, None)
            self.metrics.txn_retries.labels("usage").inc()
        raise Unavailable(f"usage report not committed after {self.max_attempts} conflicting attempts; retry")


def _job_shard(job: _GrantJob) -> int:
    return job.shard


def epoch_generations(jobs: list[_GrantJob]) -> list[list[_GrantJob]]:
    """Split jobs (order kept) so that within each part every shard has a single epoch: a
    transaction compares each shard's epoch once. Jobs of a shard accepted under a later epoch
    (this replica lost and won the shard again) go to a later part."""
    parts: list[list[_GrantJob]] = []
    index: dict[tuple[int, int], int] = {}
    epochs_seen: dict[int, int] = {}
    for job in jobs:
        i = index.get((job.shard, job.epoch))
        if i is None:
            i = index[(job.shard, job.epoch)] = epochs_seen.get(job.shard, 0)
            epochs_seen[job.shard] = i + 1
            if i == len(parts):
                parts.append([])
        parts[i].append(job)
    return parts


def pool_disjoint_groups(jobs: list[_GrantJob], max_group: int, per_wave: int,
                         shard_of: Callable[[_GrantJob], int] | None = None) -> list[list[list[_GrantJob]]]:
    """Split grant jobs into transactions of at most ``max_group`` and those into waves of at
    most ``per_wave`` transactions whose pools are disjoint (so they can commit concurrently
    without conflicting on a window). Queue order is kept within a pool. With ``shard_of``, a
    transaction also stays within etcd's compare budget: one epoch compare per shard it writes,
    plus at most one window and one grant compare per grant (``shards + 2 x grants <= 128``)."""
    by_pool: dict[str, list[_GrantJob]] = {}
    for j in jobs:
        by_pool.setdefault(j.req.pool, []).append(j)
    chunks = [b[i:i + max_group] for b in by_pool.values() for i in range(0, len(b), max_group)]
    if shard_of is not None:  # pools of one shard side by side: fewer epoch compares, fuller transactions
        chunks.sort(key=lambda c: shard_of(c[0]))
    waves: list[list[list[_GrantJob]]] = []
    current: list[list[_GrantJob]] = []
    pools_in_wave: set[str] = set()
    group: list[_GrantJob] = []
    shards_in_group: set[int] = set()
    for chunk in chunks:
        pool = chunk[0].req.pool
        shard = shard_of(chunk[0]) if shard_of is not None else 0
        over = len(shards_in_group | {shard}) + 2 * (len(group) + len(chunk)) > MAX_TXN_OPS
        if pool in pools_in_wave or len(group) + len(chunk) > max_group or over:
            if group:
                current.append(group)
                group, shards_in_group = [], set()
            if pool in pools_in_wave or len(current) >= per_wave:
                waves.append(current)
                current, pools_in_wave = [], set()
        group += chunk
        shards_in_group.add(shard)
        pools_in_wave.add(pool)
    if group:
        current.append(group)
    if current:
        waves.append(current)
    return waves


def _settle(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _receipt(rec: GrantRecord, *, replayed: bool) -> UsageReceipt:
    return UsageReceipt(lease_id=rec.grant.lease_id, granted=rec.grant.granted, spent=rec.spent,
                        returned=rec.returned, window_open=rec.window_open, replayed=replayed)


def _check_same(pool: str, region: str, req: LeaseRequest) -> None:
    if pool != req.pool or region != req.region:
        raise Conflict(f"lease id {req.lease_id!r} is already used for pool {pool!r} region {region!r}",
                       extra={"leaseId": req.lease_id})
