"""Keeps each pool balance of this region topped up from the allocator.

One ``LeaseManager`` per agent process. For every *active* balance (a pool rule was
evaluated against it recently) a background tick:

1. closes leases whose deadline passed (``pool_close`` in Redis returns granted/spent
   exactly once) and reports the spent count to the allocator (reclaim), retrying later if
   the allocator is unreachable (bounded queue);
2. reads the spendable balance and, below the low-water mark, asks for a chunk
   (single-flight per balance, tenacity retries with the same lease id inside the client),
   then deposits the grant into Redis with Redis-clock bounds derived conservatively from
   this process's monotonic deadlines;
3. when the window the balance spends from ends within the pool's prefetch time and no lease of
   the next window is held, asks for one (``window: next``), valid from the window's start: the
   requests at the rollover find it there instead of waiting for a top-up.

The engine asks :meth:`state` when a pool rule denied: ``exhausted`` is a normal 429 with a
retry hint at the next window start, ``unreachable`` means the allocator could not be
reached and no valid lease is left — only then may the pool's fallback allowance be spent. A
request that failed while this process itself stalled (its event loop late by a whole attempt's
timeout or more: SIGSTOPped, or saturated as badly) does not make a balance unreachable: the stall
spent the request's deadline, not the allocator (as the store tells a stall from a Redis failure,
``region_agent.store.lag``); the next tick asks again, and meanwhile a pool rule denies.

Every grant also tells where this process stands on the allocator's clock (``clock``, an
:class:`~region_agent.leasing.window_clock.AllocatorClock`): fallback allowances are counted per
pool window as the allocator numbers them.

Lost knowledge is resolved conservatively (docs/invariants.md I8): a lease whose Redis record is
gone at its close (a restart without persistence) or was restored from an older state (a
restart from RDB/AOF, a failover: ``pool_close`` says it is not current) is reported to the
allocator as fully spent — its tokens are stranded and counted
(``leasehold_agent_lease_lost_tokens_total``), never returned to the pool to be granted again —
and the scripts never spend a restored entry.

Cold start: :meth:`warm_up` leases every balance the bundle names before the agent reports ready.

Shutdown (SIGTERM): :meth:`begin_shutdown` stops every new lease request at once (requests still
being served spend what is held); :meth:`shutdown` then waits for top-ups in flight, closes every
held lease in Redis (``pool_close``: nothing more is spent from it, by any agent of the region)
and reports it with ``closedEarly`` so the allocator returns the unspent rest to the pool now,
retrying until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kernel.bundle import Pool
from kernel.errors import Conflict, LeaseholdError, StaleEpoch
from kernel.ratelog import KeyedLog, TransitionLog
from kernel.wire import MAX_BATCH, LeaseError, LeaseRequest, UsageReport

from .book import BalanceState, HeldLease, PoolBook, grant_window_end
from .client import AllocatorClient
from .topup import ROLLOVER_WAIT_MS, until_start_s
from .window_clock import AllocatorClock

log = logging.getLogger(__name__)

#: A lease request that failed while the event loop lagged by this share of the allocator client's
#: attempt timeout or more failed in this process (see the module text). A whole timeout: CPU
#: contention delays callbacks by tens of milliseconds, a stop by seconds.
STALL_SHARE = 1.0

#: A tick asks for a balance's next-window lease at most this often (ms; or twice the allocator's
#: round trip, if longer): an answer that held no lease of that window (the allocator found it too
#: early on its clock, or the next window already spent) is not asked again at every tick.
PREFETCH_RETRY_MS = 250.0

#: The allocator keeps a window's grant records until the window's end plus max(its length, this)
#: (``allocator.window_cache.RECORD_MIN_LINGER_MS``; etcd's expiry lease may keep them up to 16 s
#: more), then retires them: a 404 before that time is never expected. A usage report arriving
#: later (queued through an allocator outage) is answered 404 "no lease" — expected bookkeeping,
#: the allocator counted the lease's tokens as unreported when it retired the window.
RECORD_MIN_LINGER_MS = 60_000.0


class BalanceStore(Protocol):
    """The Redis side of a pool balance (implemented over the Lua scripts)."""

    async def observe(self, key: str) -> tuple[int, float, float]:
        """(spendable tokens, lower offset, upper offset) where the offsets bound
        ``redis_clock_ms - monotonic_ms`` of the node that owns ``key``."""

    async def deposit(self, key: str, lease_id: str, granted: int, valid_from_ms: int, expires_at_ms: int) -> bool: ...

    async def close(self, key: str, lease_id: str) -> Any:
        """The closed entry (``granted``, ``spent``, ``current``: written in the node's current
        incarnation), or None when absent."""


class LeaseEvents(Protocol):
    def grant(self, *, region: str, pool: str, key_tag: str, lease: HeldLease | None, grant: object,
              sent_at: float, received_at: float) -> None: ...

    def closed(self, *, region: str, pool: str, lease_id: str, granted: int, spent: int) -> None: ...


def _after_s(s: float) -> asyncio.Future:
    """A future done ``s`` seconds from now."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_later(s, lambda: fut.done() or fut.set_result(None))
    return fut


@dataclass
class Balance:
    pool: Pool
    key: str  # the Redis balance key (tenant tag or global tag)
    book: PoolBook
    last_used: float = 0.0
    inflight: asyncio.Task | None = None
    last_spendable: int = 0  # the latest reading (a tick's, or a script's)
    read_at: float = 0.0  # monotonic ms of that reading
    # leases deposited to start later, each with when it is surely spendable in Redis (monotonic ms):
    # a reading taken before then does not count it
    starting: list[tuple[HeldLease, float]] = field(default_factory=list)
    prefetch_after: float = 0.0  # monotonic ms: no tick prefetch before (one per PREFETCH_RETRY_MS)
    start_wait: asyncio.Future | None = None  # done when a lease starts: every decision at the rollover waits on it

    def spendable(self, now: float) -> int:
        """The latest reading, plus the leases that started since it was taken (or too soon
        before it to be counted in Redis): the next window's lease, deposited ahead, is spendable
        from the window's start although the reading before it said 0 - without it every decision at
        the rollover saw a balance below the low-water mark and started a top-up that took a second
        lease of the window."""
        if not self.starting:
            return self.last_spendable
        return self.last_spendable + sum(lease.granted for lease, counted_from in self.starting
                                         if lease.valid_from <= now < lease.deadline and self.read_at < counted_from)

    def read(self, spendable: int, now: float) -> None:
        """A reading of the balance in Redis, taken ``now``."""
        self.last_spendable = max(0, spendable)
        self.read_at = now
        if self.starting:
            self.starting = [(lease, counted_from) for lease, counted_from in self.starting
                             if now < counted_from and now < lease.deadline]


@dataclass
class LeaseManager:
    region: str
    client: AllocatorClient
    store: BalanceStore
    now: Callable[[], float] = field(default=lambda: time.monotonic() * 1000.0)
    tick_ms: float = 100.0
    idle_after_ms: float = 30_000.0
    horizon_ms: float = 2_000.0
    max_pending_reports: int = 10_000
    report_patience_ms: float = 120_000.0
    recorder: LeaseEvents | None = None
    metrics: object | None = None  # region_agent.service.metrics.AgentMetrics (lease_* members)
    clock: AllocatorClock = field(default_factory=AllocatorClock)
    balances: dict[str, Balance] = field(default_factory=dict)
    pending_reports: deque = field(default_factory=deque)
    # lease id -> when (self.now()) the allocator retires its window's records, for the queued reports
    _retired_after: dict = field(default_factory=dict)
    _retired_unsaid: int = 0  # reports of retired windows not taken since the last line
    _unanswered: int = 0  # reports taken off the queue by the flush under way and not yet answered
    _retired_said_at: float = float("-inf")
    _task: asyncio.Task | None = None
    _stopping: bool = False
    _warming: set = field(default_factory=set)
    _leasing: bool = True  # False from begin_shutdown(): no new lease requests
    log_interval_s: float = 10.0  # reachability and refusal lines at most this often
    # how late this process's event loop runs its callbacks now, in seconds (the store's
    # region_agent.store.lag.LoopLag): a call that failed while it lagged by STALL_SHARE of the
    # allocator client's attempt timeout or more failed in this process, not at the allocator
    lag_s: Callable[[], float] = field(default=lambda: 0.0)

    # called with a pool's id when a lease of it was deposited spendable at once (region_agent.
    # leasing.fleet_pools.FleetPools.refilled: a chunk's local denial of that pool is lifted)
    _refill_listeners: list[Callable[[str], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reachability = TransitionLog(log, initial=True, interval_s=self.log_interval_s)
        self._refusals = KeyedLog(log, interval_s=self.log_interval_s)
        if self.metrics is not None:
            # no call has failed yet: with --workers N the gauge is the lowest of the live workers',
            # and a worker that had not asked the allocator yet read 0 beside one that had
            # (LeaseholdAllocatorUnreachable went pending at every start)
            self.metrics.allocator_up.set(1)  # type: ignore[attr-defined]  # AgentMetrics

    # ----------------------------------------------------------------- engine-facing, sync
    def on_refill(self, listener: Callable[[str], None]) -> None:
        """``listener(pool_id)`` after each deposit of a lease spendable at once."""
        self._refill_listeners.append(listener)

    def note(self, pool: Pool, key: str, tokens: int) -> None:
        """Called for every decision that needed ``key``'s pool balance (allowed or not)."""
        bal = self.balances.get(key)
        now = self.now()
        if bal is None or bal.pool != pool:
            bal = self.balances[key] = Balance(pool=pool, key=key, book=PoolBook(pool))
        bal.last_used = now
        bal.book.note_demand(tokens, now)
        if self._leasing and bal.inflight is None \
                and bal.book.needs_topup(bal.spendable(now), now, self.client.last_rtt_ms):
            bal.inflight = asyncio.get_running_loop().create_task(self._topup(bal))

    def state(self, key: str) -> BalanceState:
        bal = self.balances.get(key)
        if bal is None:
            return BalanceState.IDLE
        now = self.now()
        if bal.book.exhausted(now):
            return BalanceState.EXHAUSTED
        if bal.book.unreachable_since is not None and not bal.book.valid(now):
            return BalanceState.UNREACHABLE
        return BalanceState.OK

    def cold(self, key: str) -> bool:
        """``key``'s balance holds no lease spendable now, is not exhausted and the allocator was not
        found unreachable: a balance used for the first time, or again after an idle spell past the
        top-up horizon (an idle balance buys no leases). Its next request needs one top-up's round
        trip (the engine lets it wait for that: ``cold_lease_wait_ms``)."""
        if not self._leasing:
            return False
        bal = self.balances.get(key)
        if bal is None:
            return True  # the request about to be noted starts its first top-up
        now = self.now()
        return not bal.book.valid(now) and not bal.book.exhausted(now) and bal.book.unreachable_since is None

    def pending(self, key: str) -> asyncio.Task | None:
        """The in-flight top-up for ``key``'s balance, if any (the engine may wait for it once)."""
        bal = self.balances.get(key)
        return bal.inflight if bal is not None else None

    def observed(self, key: str, spendable: int, starts_in_ms: int = 0,
                 within_ms: float = 0.0) -> asyncio.Future | None:
        """A script just saw ``key``'s spendable balance (e.g. empty after a Redis restart lost the
        deposits): take it as the latest reading, start a top-up if it is below the low-water mark,
        and return the in-flight top-up, if any.

        ``starts_in_ms``: the script also saw a lease of this balance that is not spendable yet
        start in that many ms (0: none) - at a window's end, the next window's lease. When no top-up
        is started for it (:meth:`PoolBook.needs_topup`: its grant would land after the window it is
        for) and that lease starts within :data:`~region_agent.leasing.topup.ROLLOVER_WAIT_MS` (or a
        round trip, or ``within_ms``: what the decision may still wait, if longer), the returned
        future is done when it starts: the decision waits for it, within its budget, as for a top-up.
        (A top-up is not asked within two round trips of that start, so a lease starting later than
        a round trip would otherwise deny every decision until then although their budgets cover
        the wait.)"""
        bal = self.balances.get(key)
        if bal is None:
            return None
        now = self.now()
        bal.read(spendable, now)
        if bal.inflight is not None:
            return bal.inflight
        rtt_ms = self.client.last_rtt_ms
        if self._leasing and bal.book.needs_topup(bal.spendable(now), now, rtt_ms):
            bal.inflight = asyncio.get_running_loop().create_task(self._topup(bal))
            return bal.inflight
        if 0 < starts_in_ms <= max(ROLLOVER_WAIT_MS, rtt_ms, within_ms - 1):
            return self.lease_start(key, starts_in_ms)
        return None

    def lease_start(self, key: str, starts_in_ms: int) -> asyncio.Future | None:
        """A future done when a lease of ``key``'s balance that the script found ``starts_in_ms``
        ahead starts (one for every decision waiting on it); None for a balance not followed."""
        bal = self.balances.get(key)
        if bal is None:
            return None
        if bal.start_wait is None or bal.start_wait.done():
            bal.start_wait = _after_s(until_start_s(starts_in_ms))
        return bal.start_wait

    def view(self) -> list[dict]:
        """Operator view (``GET /v1/leases``): per balance, the leases held and their timing."""
        now = self.now()
        out = []
        for bal in self.balances.values():
            out.append({
                "pool": bal.pool.id, "state": self.state(bal.key), "spendable": bal.spendable(now),
                "maxEpoch": bal.book.max_epoch, "demandPerS": round(bal.book.demand_rate, 2),
                "leases": [{"leaseId": lease.lease_id, "window": lease.window_index, "granted": lease.granted,
                            "epoch": lease.epoch, "validInMs": max(0, int(lease.valid_from - now)),
                            "expiresInMs": int(lease.deadline - now)} for lease in bal.book.leases.values()],
            })
        return out

    def retry_hint_ms(self, key: str) -> int:
        bal = self.balances.get(key)
        if bal is None:
            return 0
        now = self.now()
        if bal.book.exhausted(now):
            return bal.book.exhausted_retry_ms(now)
        return int(self.client.last_rtt_ms) + 1

    # ----------------------------------------------------------------- cold start
    def warm_up(self, balances: list[tuple[Pool, str]]) -> None:
        """Lease each (pool, balance key) that holds nothing yet, now, so the first requests find a
        lease (cold start). :attr:`warming` is True until every one was answered (granted,
        exhausted or failed: bounded by the allocator client's deadline)."""
        now = self.now()
        for pool, key in balances:
            bal = self.balances.get(key)
            if bal is None or bal.pool != pool:
                bal = self.balances[key] = Balance(pool=pool, key=key, book=PoolBook(pool))
            bal.last_used = now
            task = asyncio.get_running_loop().create_task(self._warm(bal))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    @property
    def warming(self) -> bool:
        return bool(self._warming)

    async def _warm(self, bal: Balance) -> None:
        try:
            spendable, _, _ = await self.store.observe(bal.key)
        except LeaseholdError:
            return  # Redis unreachable: readiness says so; the first requests wait for a top-up
        bal.read(spendable, self.now())
        if bal.last_spendable > 0 or not self._leasing:
            return  # another agent of the region already holds a lease for it, or shutting down
        if bal.inflight is None:
            bal.inflight = asyncio.get_running_loop().create_task(self._topup(bal))
        await asyncio.shield(bal.inflight)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-manager")

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._warming):
            task.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for bal in self.balances.values():
            if bal.inflight:
                bal.inflight.cancel()
        await asyncio.gather(*(b.inflight for b in self.balances.values() if b.inflight), return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a tick must never kill the manager; the next one retries
                log.exception("lease manager tick failed")
            await asyncio.sleep(self.tick_ms / 1000.0)

    async def tick(self) -> None:
        now = self.now()
        for key, bal in list(self.balances.items()):
            for lease in bal.book.expired(now):
                await self._close(bal, lease)
            if now - bal.last_used > self.idle_after_ms and not bal.book.leases:
                del self.balances[key]
                continue
            try:
                spendable, _, _ = await self.store.observe(bal.key)
            except LeaseholdError:
                continue
            bal.read(spendable, now)
            if self.metrics is not None:
                self.metrics.lease_balance.labels(bal.pool.id).set(bal.last_spendable)
            # top up ahead of demand only for balances spent from recently: an idle balance would
            # otherwise buy a lease every TTL that expires unspent (stranded at the window end)
            if not self._leasing or bal.inflight is not None or now - bal.last_used > self.horizon_ms:
                continue
            rtt_ms = self.client.last_rtt_ms
            if bal.book.needs_topup(bal.spendable(now), now, rtt_ms):
                bal.inflight = asyncio.get_running_loop().create_task(self._topup(bal))
            elif now >= bal.prefetch_after and bal.book.prefetch_due(now, rtt_ms):
                bal.prefetch_after = now + max(PREFETCH_RETRY_MS, 2 * rtt_ms)
                bal.inflight = asyncio.get_running_loop().create_task(self._prefetch(bal))
        await self._flush_reports()

    # ----------------------------------------------------------------- grants
    def _stalled(self) -> bool:
        """This process's event loop lags by :data:`STALL_SHARE` of an attempt's timeout or more."""
        return self.lag_s() >= self.client.attempt_timeout_s * STALL_SHARE

    async def _topup(self, bal: Balance) -> None:
        """One top-up: a lease of the current window, then the next window's when the current one
        ends within the pool's prefetch time and none is held yet. A grant that came too late to
        be spent in its window (the window ended within the round trip) leaves no valid lease; the
        window it named still ends soon, so the next window's lease is asked for at once (or the
        new current window's, if it already began): without it a balance woken after an idle spell
        near a window's end had nothing to spend, and nothing asked for, until the next decision's
        top-up."""
        try:
            answered_end = await self._request(bal, "current")
            now = self.now()
            valid = bal.book.valid(now)
            until_end = min((lease.window_end for lease in valid), default=None) if valid else answered_end
            if self._leasing and until_end is not None and until_end - now <= bal.pool.prefetch_ms \
                    and not bal.book.future(now):
                await self._request(bal, "next" if until_end > now else "current")
        finally:
            bal.inflight = None

    async def _prefetch(self, bal: Balance) -> None:
        """The next window's lease, asked for by the tick while the balance still pays
        (:meth:`PoolBook.prefetch_due`): spendable from the window's start, so the requests at the
        rollover find it there."""
        try:
            await self._request(bal, "next")
        finally:
            bal.inflight = None

    async def _request(self, bal: Balance, window: Literal["current", "next"]) -> float | None:
        """Ask for one lease and deposit it. Returns the end of the window the grant named
        (:func:`grant_window_end`) when tokens were granted and Redis
        took the deposit or the lease was dropped only for its timing (too late to be spent);
        None otherwise (nothing granted, the allocator or Redis failing: no second request)."""
        lease_id = f"{self.region}-{uuid.uuid4().hex}"
        req = LeaseRequest(lease_id=lease_id, region=self.region, pool=bal.pool.id,
                           want=bal.book.want(self.horizon_ms, self.now()), demand=int(bal.book.demand_rate),
                           window=window)
        sent_at = self.now()
        m = self.metrics
        try:
            grant = await self.client.lease(req)
        except LeaseholdError as e:
            # a retriable failure while this process stalled (SIGSTOPped, a saturated loop: the
            # attempt's timer fired late, its deadline spent by the stall) says nothing of the
            # allocator: no fallback allowance for it; the next tick asks again
            unreachable = e.retriable and not self._stalled()
            if unreachable:
                bal.book.note_unreachable(self.now())
            if m is not None:
                # a prefetch the allocator found early (the next window's prefetch time had not
                # opened on its clock) is timing, asked again by the next tick: not a refusal
                early = window == "next" and isinstance(e, Conflict)
                m.lease_grants.labels(bal.pool.id, "unreachable" if e.retriable else "early" if early else "refused").inc()
                if unreachable or not e.retriable:
                    m.allocator_up.set(0 if e.retriable else 1)
            log.debug("lease request for pool %s failed%s: %s", bal.pool.id,
                      "" if unreachable or not e.retriable else " while this process stalled", e.detail)
            if unreachable:
                self._reachability.observe(False, self._reachability_line)
            elif not e.retriable and not isinstance(e, Conflict):  # a refusal other than prefetch timing:
                # a configuration problem
                self._refusals.log((bal.pool.id, e.code), logging.WARNING,
                                   f"lease request for pool {bal.pool.id} refused: {e.detail}")
            return None
        self._reachability.observe(True, self._reachability_line)
        received_at = self.now()
        if not grant.replayed:  # a replay carries the original issuedAtMs
            self.clock.observe(sent_at, received_at, grant.issued_at_ms)
        if m is not None:
            m.allocator_up.set(1)
            m.allocator_latency.labels("lease").observe((received_at - sent_at) / 1000.0)
            outcome = "granted" if grant.granted > 0 else "exhausted"
            m.lease_grants.labels(bal.pool.id, outcome).inc()
            m.lease_tokens.labels(bal.pool.id).inc(grant.granted)
            if grant.granted == 0:
                m.lease_depletions.labels(bal.pool.id).inc()
        try:
            lease = bal.book.accept(grant, sent_at=sent_at, received_at=received_at, requested_id=lease_id)
        except StaleEpoch as e:
            if m is not None:
                m.lease_grants.labels(bal.pool.id, "stale_epoch").inc()
            log.warning("refused grant: %s", e.detail)
            return None
        log.debug("pool %s: %s lease of window %d asked for %d, granted %d, spendable in %d ms for %d ms",
                  bal.pool.id, window, grant.window.index, req.want, grant.granted,
                  int(lease.valid_from - received_at) if lease else 0,
                  int(lease.deadline - max(received_at, lease.valid_from)) if lease else 0)
        if self.recorder:
            self.recorder.grant(region=self.region, pool=bal.pool.id, key_tag=bal.key, lease=lease, grant=grant,
                                sent_at=sent_at, received_at=received_at)
        if grant.granted <= 0:
            return None
        window_end = grant_window_end(grant, sent_at)
        if lease is None:
            return window_end
        try:
            _, lo, hi = await self.store.observe(bal.key)
        except LeaseholdError:
            # Redis cannot take the deposit, and nothing was written (observe only reads): the grant
            # goes back to the allocator at once (closed early, nothing spent) and no top-up is asked
            # for a while. Asking again at every decision of a Redis outage otherwise took the
            # window's whole G lease by lease, every one of them stranded.
            self._undeposited(bal, lease.lease_id)
            return None  # (and no top-up for a while: see _undeposited)
        # end no later than the deadline (lower offset); a prefetched lease starts no earlier than its
        # window (upper offset). A lease of the window in progress is spendable at once: rounding
        # its start up by the offset's uncertainty (one Redis round trip, a hundred ms and more on a
        # busy machine) only kept a balance woken after an idle spell from its first lease.
        valid_from = int(lease.valid_from + hi + 0.999) if grant.starts_in_ms > 0 else int(lease.valid_from + lo)
        expires_at = int(lease.deadline + lo)
        if expires_at <= valid_from:
            bal.book.forget(lease.lease_id)
            return window_end
        try:
            stored = await self.store.deposit(bal.key, lease.lease_id, lease.granted, valid_from, expires_at)
        except LeaseholdError:
            # an ambiguous deposit may have landed; keep the lease in the book so it is closed and
            # reported at its deadline (conservatively fully spent if its record is not found), and
            # ask for no other lease for a while (Redis is failing: another would fare no better)
            log.warning("deposit of lease %s into Redis failed", lease.lease_id)
            bal.book.note_refused(self.now())
            return None
        if not stored:  # refused ('full' / 'expired'): certainly nothing written, nothing spent
            self._undeposited(bal, lease.lease_id)
            return None
        if lease.valid_from <= self.now():
            # count it now: until the next tick reads Redis, a stale reading would make every
            # decision in between start another top-up for a balance that is already full
            bal.last_spendable += lease.granted
            for listener in self._refill_listeners:
                listener(bal.pool.id)
        else:  # counted from its start (Balance.spendable); in Redis surely from valid_from on its clock
            bal.starting.append((lease, lease.valid_from + (hi - lo) + 1))
        return window_end

    def _undeposited(self, bal: Balance, lease_id: str) -> None:
        """A granted lease certainly not written to Redis: forgotten, reported closed early with
        nothing spent (the allocator returns its tokens now; a plain report would wait for its
        expiry, and a loop of failed deposits would hold the whole pool meanwhile), and no top-up
        for the book's back-off."""
        bal.book.forget(lease_id)
        self._queue_report(bal, lease_id, 0, early=True)
        bal.book.note_refused(self.now())
        if self.metrics is not None:
            self.metrics.lease_grants.labels(bal.pool.id, "undeposited").inc()

    # ----------------------------------------------------------------- reclaim
    def _reachability_line(self, reachable: object, changes: int) -> tuple[int, str]:
        more = f" ({changes - 1} more changes since the last line)" if changes > 1 else ""
        if reachable:
            return logging.INFO, f"allocator reachable again: leases granted{more}"
        return logging.WARNING, ("allocator unreachable: no lease could be requested; pool rules spend the "
                                 f"held leases, then their fallback allowance{more}")

    def begin_shutdown(self) -> None:
        """Stop requesting leases (safe to call from a signal handler: it only sets a flag)."""
        self._leasing = False

    async def shutdown(self, timeout_s: float = 5.0) -> tuple[int, int]:
        """Stop leasing, let top-ups in flight finish (their grants are deposited, then returned),
        close every held lease in Redis and report it early; bounded by ``timeout_s``. Returns
        (leases closed, reports not sent). Leases that could not be closed (Redis down) or reported
        (allocator down) stay unreported: the allocator counts them as spent, which is safe."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.begin_shutdown()
        self._stopping = True
        for task in list(self._warming):  # a cold-start warm-up still waiting
            task.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        inflight = [b.inflight for b in self.balances.values() if b.inflight]
        if inflight:
            done, pending = await asyncio.wait(inflight, timeout=max(0.0, deadline - loop.time()))
            for t in pending:
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
        closed = 0
        for bal in list(self.balances.values()):
            for lease in list(bal.book.leases.values()):
                if loop.time() < deadline and await self._close(bal, lease, early=lease.deadline > self.now()):
                    closed += 1

        async def flush() -> None:
            while self.pending_reports:
                await self._flush_reports()
                if self.pending_reports:
                    await asyncio.sleep(0.05)

        with contextlib.suppress(TimeoutError):  # the deadline bounds the reports, retries included
            await asyncio.wait_for(flush(), max(0.0, deadline - loop.time()))
        log.info("shutdown: %d held leases closed, %d usage reports not delivered", closed, self.reports_pending)
        return closed, self.reports_pending

    async def _close(self, bal: Balance, lease: HeldLease, *, early: bool = False) -> bool:
        try:
            res = await self.store.close(bal.key, lease.lease_id)
        except LeaseholdError:
            return False  # Redis unreachable: try again next tick
        bal.book.forget(lease.lease_id)
        granted = lease.granted
        if res is not None and res.current:
            spent = min(res.spent, granted)
            if self.metrics is not None and granted > spent:
                self.metrics.lease_stranded.labels(bal.pool.id).inc(granted - spent)
        else:
            # the record is gone (a restart without persistence, a lost deposit) or was restored from
            # an older state (RDB/AOF, a failover): its spent count is unknown or may miss debits.
            # Fully spent: the tokens are stranded, never returned to be granted again.
            spent = granted
            known = min(res.spent, granted) if res is not None else 0
            log.warning("lease %s of pool %s: Redis record %s; reported fully spent (%d of %d tokens unaccounted)",
                        lease.lease_id, bal.pool.id, "restored from an older state" if res is not None else "lost",
                        granted - known, granted)
            if self.metrics is not None:
                self.metrics.lease_lost.labels(bal.pool.id).inc(granted - known)
        if self.recorder:
            self.recorder.closed(region=self.region, pool=bal.pool.id, lease_id=lease.lease_id,
                                 granted=granted, spent=spent)
        self._queue_report(bal, lease.lease_id, spent, early=early, window_end=lease.window_end)
        return True

    def _reopen(self, pool_id: str) -> None:
        """A usage report of ours gave tokens back to the pool's window while it is open: a balance
        of that pool that was told the window is exhausted may ask again. Otherwise nobody would:
        every balance that heard "exhausted" waits for the next window, and the returned tokens
        would stay in the pool unused while requests are denied."""
        for bal in self.balances.values():
            if bal.pool.id == pool_id:
                bal.book.reopen()

    @property
    def reports_pending(self) -> int:
        """Usage reports not yet delivered: those queued and those of a flush under way that the
        allocator has not answered (the queue alone reads 0 while a flush waits on the allocator)."""
        return len(self.pending_reports) + self._unanswered

    def _queue_report(self, bal: Balance, lease_id: str, spent: int, *, early: bool = False,
                      window_end: float | None = None) -> None:
        """``window_end``: the lease's window's end (``HeldLease.window_end``), when known: a 404
        after the allocator retired that window's records is expected (:meth:`_not_taken`)."""
        if self.reports_pending < self.max_pending_reports:
            report = UsageReport(lease_id=lease_id, region=self.region, pool=bal.pool.id, spent=spent,
                                 closed_early=early)
            self.pending_reports.append((report, self.now()))
            if window_end is not None:
                self._retired_after[lease_id] = window_end + max(bal.pool.window_ms, RECORD_MIN_LINGER_MS)

    def _not_taken(self, report: UsageReport, res: LeaseError) -> None:
        """A report the allocator refused (a 4xx but 409). "no lease" (404) for a lease whose window
        the allocator has retired by now is expected — reports queued through an allocator outage
        longer than the records' linger — and counted in one INFO line at most every
        ``log_interval_s``; any other refusal (a 404 for a window whose records should still be
        there: the allocator lost them, or another prefix/etcd answers) stays a WARNING per lease."""
        retired_after = self._retired_after.get(report.lease_id)
        if res.status == 404 and retired_after is not None and self.now() >= retired_after:
            self._retired_unsaid += 1
            return
        log.warning("usage report for %s refused: %s", report.lease_id, res.detail)

    def _say_retired(self) -> None:
        """The count of reports not taken because their windows were retired, at most once per
        ``log_interval_s`` (the last count said on a later tick once the interval is over)."""
        now = self.now()
        if not self._retired_unsaid or now - self._retired_said_at < self.log_interval_s * 1000:
            return
        log.info("%d usage reports not taken since the last line: their windows ended before the allocator "
                 "received them and it had retired their records (expected after an allocator outage longer "
                 "than a window plus max(its length, 60 s); their tokens were counted as unreported)",
                 self._retired_unsaid)
        self._retired_unsaid, self._retired_said_at = 0, now

    async def _flush_reports(self) -> None:
        """Send the queued usage reports, in batches (``AllocatorClient.report_many``: up to 512 a
        request, split per shard leader). The region's deadline comes before the allocator's
        expiry, so the allocator may answer 409 (not yet expired): such a report is retried on
        later ticks for ``report_patience_ms``; reports the allocator could not take (unreachable,
        overloaded, not leading) stay queued in order for the next tick."""
        queued = [self.pending_reports.popleft() for _ in range(len(self.pending_reports))]
        done = 0  # queued[:done] are answered (taken, requeued for later, or refused)
        self._unanswered = len(queued)
        try:
            for i in range(0, len(queued), MAX_BATCH):
                part = queued[i:i + MAX_BATCH]
                results = await self.client.report_many([report for report, _ in part])
                done = i + len(part)
                kept: list[tuple[UsageReport, float]] = []
                for (report, first), res in zip(part, results, strict=True):
                    if not isinstance(res, LeaseError):
                        self._retired_after.pop(report.lease_id, None)
                        if res.returned > 0 and res.window_open:
                            self._reopen(report.pool)
                        continue
                    if res.status == 409:
                        if self.now() - first < self.report_patience_ms:
                            self.pending_reports.append((report, first))
                            continue
                        log.warning("usage report for %s dropped: %s", report.lease_id, res.detail)
                    elif res.status >= 500:
                        kept.append((report, first))
                        continue
                    else:
                        self._not_taken(report, res)
                    self._retired_after.pop(report.lease_id, None)
                if kept:  # the allocator is not taking reports now: keep the rest for the next tick
                    self.pending_reports.extendleft(reversed(kept + queued[done:]))
                    done = len(queued)
                    break
                self._unanswered = len(queued) - done
        finally:
            # a flush cancelled while a batch was on its way (the shutdown's deadline) puts what was
            # not answered back at the head of the queue: still pending, and counted as undelivered
            self.pending_reports.extendleft(reversed(queued[done:]))
            self._unanswered = 0
        self._say_retired()
