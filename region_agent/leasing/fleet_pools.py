"""Fleet-wide (global-scope) pools: per-agent chunks bought from the region's
``{g:<pool>}`` balance, and their degraded answers.

One :class:`FleetPools` per agent. :meth:`take` answers one request's spend of one pool:

* the held chunk pays it (no store call);
* shortly before a part of the chunk ends, its unspent rest is taken out and refunded to the
  leases it was bought from (``pool_refund.lua``, one timer per pool, never on a request's path:
  :meth:`FleetPools.refund_lead_ms`; docs/decisions/0042-a-chunk-parts-rest-is-refunded-before-it-ends.md);
* the chunk is spent: one renewal per pool at a time buys the next chunk (``pool_take.lua``:
  valid no longer than the leases it came from, so never past their window — whichever agent
  deposited them), sized by what this agent's requests ask of the pool (``chunks.chunk_size``: a
  chunk's unspent rest expires with it). A request waits for the renewal within its own budget; if the renewal
  (e.g. waiting for the allocator's top-up of the regional balance) outlasts it, the request is
  denied locally with a short hint (``DENY_LOCAL``) — never admitted from a fallback allowance;
* the chunk still holds tokens but fewer than this request costs: the request buys exactly its
  cost for itself, leaving the chunk to the requests it can pay, and if it cannot, it alone (and
  requests at least as expensive, briefly) is denied;
* the regional balance is empty and the allocator is *unreachable*: a chunk of one request's cost
  from the region's fallback allowance (``fallbackPerRegion`` per allocator window, in Redis,
  ``lua/lib/pool_window.lua``); exhausted (the allocator said so): a 429 until the next window;
* Redis itself cannot be reached: this agent's in-process allowance, ``fallbackPerRegion`` per
  allocator window (:class:`region_agent.decision.fallback.LocalAllowances`), or 503 for a
  closed rule; the agent overloaded: shed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kernel.algorithms.pool_window import KIND as POOL_WINDOW
from kernel.algorithms.pool_window import MAX_SPAN
from kernel.bundle import Pool
from kernel.errors import LeaseholdError, Overloaded, ScriptRejected

from ..decision.call import (
    Call,
    PoolTake,
    multi_rule_call,
    parse_multi_rule,
    parse_pool_refund,
    parse_pool_take,
    pool_refund_call,
    pool_take_call,
)
from ..decision.fallback import LocalAllowances, pool_item
from ..decision.keys import KeyBuilder
from ..decision.plan import GlobalSpend
from ..store.protocol import Store
from .book import BalanceState
from .chunks import NO_CHUNK, Chunk, Part, tokens_per_s
from .redis_balance import BALANCE_SLACK_MS
from .topup import ROLLOVER_WAIT_MS, ROLLOVER_WAITS, topped_up, until_start_s
from .window_clock import Windows


class TakeStatus(StrEnum):
    """How one request's spend of a fleet-wide pool went."""

    OK = "ok"  # reserved from a chunk (or an allowance): the caller gives it back if it is not admitted
    DENIED = "denied"  # a 429 (the pool, or its allowance, cannot pay now)
    UNAVAILABLE = "unavailable"  # a closed rule without its allocator: 503
    OPEN = "open"  # fails open: admitted without a check
    SHED = "shed"  # this agent is overloaded


class Renewal(StrEnum):
    """How a chunk renewal went (the ``outcome`` label of ``pool_renewals``)."""

    GRANTED = "granted"
    PARTIAL = "partial"  # all the balance had
    DENIED = "denied"
    FALLBACK = "fallback"
    FALLBACK_DENIED = "fallback_denied"
    ERROR = "error"


log = logging.getLogger(__name__)

# A request waits for at most this many renewals (each paid the requests that waited longer, FIFO),
# and takes from the last one it waited for before it is denied as busy
RENEWALS_PER_REQUEST = 3
# A renewal whose part ended before its reply arrived (the lease it was bought from ended within the
# round trip: a window's last moments on a slow store) buys again, at most this many times: the next
# take is sent after that end, so the store no longer sells from that lease
LATE_PARTS = 2
# A part's unspent rest is taken out and refunded this long before the part ends (see refund_lead_ms):
# REFUND_RTTS store round trips of pool_take as recently measured, within [REFUND_LEAD_MIN_MS,
# REFUND_LEAD_MAX_MS]. The tokens stay in the region's balance (a renewal may buy them back), so an
# early refund costs at most one renewal; a late one lands after the lease's end (still accepted while
# its record is kept) or after its close (refused: abandoned).
REFUND_RTTS = 4
REFUND_LEAD_MIN_MS = 50.0
REFUND_LEAD_MAX_MS = 250.0
# a refund's store call waits this long at least (it is no request's: its budget is not the decision's)
REFUND_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class Take:
    status: TakeStatus
    retry_ms: int = 0
    generation: int = NO_CHUNK  # the chunk the tokens came from (for a give-back); NO_CHUNK otherwise
    fallback: bool = False  # admitted from (or denied by) a fallback allowance


class FleetPools:
    def __init__(self, *, store: Store, metrics: Any, leases: Any | None, now_ms: Callable[[], float],
                 windows: Callable[[Pool], Windows], allowance: LocalAllowances, budget_s: float,
                 hold_ms: int | None = None):
        self.store = store
        self.metrics = metrics
        self.leases = leases  # region_agent.leasing.manager.LeaseManager, or None
        self.now_ms = now_ms
        self.windows = windows
        self.allowance = allowance
        self.budget_s = budget_s
        # a chunk's local denial is held at most this long (None: the whole hint); see chunks.py
        self.hold_ms = hold_ms
        self.chunks: dict[str, Chunk] = {}
        self._renewing: dict[str, asyncio.Future] = {}
        # refunds: one timer per pool at the next part's refund time; refund ids are this process's
        # nonce and the part's generation (unique per part, never reused by a restarted agent)
        self.nonce = uuid.uuid4().hex[:16]
        self._rtt_ms = REFUND_LEAD_MIN_MS / REFUND_RTTS  # pool_take round trip, smoothed
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self._refunding: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ requests
    async def take(self, spend: GlobalSpend, deadline_s: float, clock_s: Callable[[], float]) -> Take:
        pool = spend.pool
        chunk = self.chunks.setdefault(pool.id, Chunk())
        gkey = KeyBuilder.global_pool_key(pool.id)
        chunk.ask(spend.cost, self.now_ms(), pool.chunk_validity_ms)
        if self.leases is not None:  # demand is what requests ask for, not what chunks buy
            self.leases.note(pool, gkey, spend.cost)
        for renewals in range(RENEWALS_PER_REQUEST + 1):
            now = self.now_ms()
            part = chunk.try_take(spend.cost, now)
            if part is not None:
                return Take(TakeStatus.OK, generation=part.generation, fallback=part.fallback)
            if chunk.negative(now, spend.cost):
                return Take(TakeStatus.DENIED, chunk.retry_ms(now), fallback=chunk.fallback)
            if chunk.usable(now) > 0:  # the chunk still pays cheaper requests: buy this one's cost alone
                return await self._take_alone(spend, chunk, deadline_s, clock_s)
            if renewals == RENEWALS_PER_REQUEST:  # requests before it spent each chunk it waited for
                break
            chunk.waiting += spend.cost  # the renewal buys at least what its waiting requests need
            try:
                await asyncio.wait_for(asyncio.shield(self._renewal(spend, chunk)), max(0.0, deadline_s - clock_s()))
            except TimeoutError:
                break  # the renewal outlasts this request's budget
            except LeaseholdError as e:
                return self._store_failed(spend, e)
            finally:
                chunk.waiting -= spend.cost
        return self._busy(pool, gkey)

    def give_back(self, spend: GlobalSpend, generation: int) -> None:
        """A reservation whose request was not admitted: its tokens go back to the part of the chunk
        they came from, kept while valid even if a renewal landed meanwhile (not a part bought since,
        nor one bought for that request alone: ``NO_CHUNK``; those tokens are counted abandoned)."""
        chunk = self.chunks.get(spend.pool.id)
        if chunk is not None:
            chunk.give_back(spend.cost, generation, self.now_ms(), spend.pool.chunk_validity_ms)

    def refilled(self, pool_id: str) -> None:
        """The lease manager deposited a lease of ``pool_id`` spendable now: a chunk's local denial
        of that pool is lifted (:meth:`Chunk.lift`). Other agents of the region keep theirs until
        their hold ends (at most ``hold_ms``)."""
        chunk = self.chunks.get(pool_id)
        if chunk is not None:
            chunk.lift()

    def remaining(self, pool_id: str) -> int:
        chunk = self.chunks.get(pool_id)
        return chunk.usable(self.now_ms()) if chunk else 0

    # ------------------------------------------------------------------ answers without a chunk
    def _busy(self, pool: Pool, gkey: str) -> Take:
        """A renewal is in flight and this request's budget is over: deny locally
        with the time a top-up takes as the hint. Not a fallback: the allocator
        and Redis are answering, only slower than this request could wait."""
        hint = self.leases.retry_hint_ms(gkey) if self.leases is not None else 1
        self.metrics.pool_busy.labels(pool.id).inc()
        return Take(TakeStatus.DENIED, max(1, hint))

    def _store_failed(self, spend: GlobalSpend, e: LeaseholdError) -> Take:
        if isinstance(e, Overloaded):
            return Take(TakeStatus.SHED)
        if isinstance(e, ScriptRejected):  # a policy defect: never an admission
            self.metrics.degradations.labels("POOL_POLICY_ERROR", "closed").inc()
            return Take(TakeStatus.UNAVAILABLE, spend.rule.closed_retry_after_ms)
        return self.local_allowance(spend)

    def local_allowance(self, spend: GlobalSpend) -> Take:
        """Redis (the regional balance) cannot be reached: a local_bounded rule spends this agent's
        in-process allowance of fallbackPerRegion per allocator window — the Redis-loss term of
        the overshoot bound (docs/invariants.md I8: the read path answers from local allowances)."""
        rule, pool = spend.rule, spend.pool
        mode = rule.fail_mode or "closed"
        if mode == "local_bounded" and pool.fallback_per_region > 0:
            self.metrics.degradations.labels("POOL_RENEWAL_FAILED", "local_bounded").inc()
            w = self.windows(pool)
            item = pool_item(pool.id, w, spend.cost, pool.fallback_per_region, w.end_in_ms + pool.window_ms)
            if item is None:  # the allocator's clock is too uncertain to count per window
                return Take(TakeStatus.DENIED, max(1, w.end_in_ms), fallback=True)
            res = self.allowance.admit([item], int(self.now_ms()))
            return Take(TakeStatus.OK, fallback=True) if res.allowed else Take(TakeStatus.DENIED, max(1, res.retry_after_ms),
                                                                      fallback=True)
        self.metrics.degradations.labels("POOL_RENEWAL_FAILED", mode).inc()
        if mode == "open":
            return Take(TakeStatus.OPEN)
        return Take(TakeStatus.UNAVAILABLE, rule.closed_retry_after_ms)

    # ------------------------------------------------------------------ buying tokens
    async def _pool_take(self, gkey: str, min_tokens: int, want: int, per_s: int = 0, waiting: int = 0) -> PoolTake:
        sent = time.monotonic()
        (reply,) = await self.store.submit([pool_take_call(gkey, min_tokens=min_tokens, want=want,
                                                           slack_ms=BALANCE_SLACK_MS, per_s=per_s,
                                                           waiting=waiting)],
                                           wait_s=self.budget_s)
        self._rtt_ms += ((time.monotonic() - sent) * 1000.0 - self._rtt_ms) / 8
        return parse_pool_take(reply)

    # ------------------------------------------------------------------ refunds
    def refund_lead_ms(self) -> float:
        """How long before a part's end its unspent rest is refunded: a few recent pool_take round
        trips (the refund must land before the lease's close, which comes at the earliest at the
        lease's end), within [REFUND_LEAD_MIN_MS, REFUND_LEAD_MAX_MS]."""
        return min(REFUND_LEAD_MAX_MS, max(REFUND_LEAD_MIN_MS, REFUND_RTTS * self._rtt_ms))

    def _arm(self, pool: Pool) -> None:
        """Set the pool's timer to the next part's refund time (if earlier than the one set)."""
        chunk = self.chunks.get(pool.id)
        if chunk is None:
            return
        now = self.now_ms()
        at = chunk.refund_at_ms(now, self.refund_lead_ms())
        if at is None:
            return
        held = self._timers.get(pool.id)
        if held is not None:
            if held[0] <= at:
                return
            held[1].cancel()
        handle = asyncio.get_running_loop().call_later(max(0.0, at - now) / 1000.0, self._fire, pool)
        self._timers[pool.id] = (at, handle)

    def _fire(self, pool: Pool) -> None:
        self._timers.pop(pool.id, None)
        task = asyncio.get_running_loop().create_task(self._refund_due(pool))
        self._refunding.add(task)
        task.add_done_callback(self._refunding.discard)

    async def _refund_due(self, pool: Pool) -> None:
        """Refund every part due (its rest taken out of the chunk first), then arm for the next."""
        chunk = self.chunks.get(pool.id)
        if chunk is None:
            return
        try:
            due = chunk.due_refunds(self.now_ms(), self.refund_lead_ms())
            for part, tokens in due:
                refunded = await self._refund(pool, part, tokens)
                if refunded:
                    self.metrics.chunk_refunded.labels(pool.id).inc(refunded)
                if tokens > refunded:
                    log.debug("pool %s: part %d refunded %d of %d tokens (the rest abandoned)", pool.id,
                              part.generation, refunded, tokens)
                    self.metrics.chunk_abandoned.labels(pool.id).inc(tokens - refunded)
            wasted = chunk.take_abandoned()  # parts that ended meanwhile (no renewal may follow them)
            if wasted:
                self.metrics.chunk_abandoned.labels(pool.id).inc(wasted)
        finally:
            self._arm(pool)

    async def _refund(self, pool: Pool, part: Part, tokens: int) -> int:
        """``pool_refund.lua`` for ``tokens`` of ``part``; the tokens it gave back (0: refused, or
        the store failed twice — the same refund id, so a retry never gives back twice)."""
        gkey = KeyBuilder.global_pool_key(pool.id)
        call = pool_refund_call(gkey, KeyBuilder.global_pool_refund_key(pool.id, f"{self.nonce}-{part.generation}"),
                                tokens=tokens, slack_ms=BALANCE_SLACK_MS, debits=part.debits)
        for attempt in range(2):
            try:
                (reply,) = await self.store.submit([call], wait_s=max(self.budget_s, REFUND_WAIT_S))
                return min(tokens, parse_pool_refund(reply).refunded)
            except ScriptRejected:
                log.warning("pool %s: refund of %d tokens rejected by the store", pool.id, tokens)
                return 0
            except LeaseholdError as e:
                if attempt:
                    log.debug("pool %s: refund of %d tokens failed: %s", pool.id, tokens, e)
        return 0

    async def _take_alone(self, spend: GlobalSpend, chunk: Chunk, deadline_s: float,
                          clock_s: Callable[[], float]) -> Take:
        """A request the held chunk cannot pay buys exactly its cost from the regional balance,
        waiting (within its budget) for one top-up; failing that, it is denied alone."""
        pool, cost = spend.pool, spend.cost
        gkey = KeyBuilder.global_pool_key(pool.id)
        try:
            for attempt in range(2):
                got = await self._pool_take(gkey, cost, cost)
                if got.taken:
                    self.metrics.pool_renewals.labels(pool.id, "alone").inc()
                    return Take(TakeStatus.OK)
                pending = self.leases.observed(gkey, got.remaining) if self.leases is not None else None
                left = deadline_s - clock_s()
                if attempt or pending is None or left <= 0 or not await topped_up(pending, left):
                    break
        except LeaseholdError as e:
            return self._store_failed(spend, e)
        hint = self.leases.retry_hint_ms(gkey) if self.leases is not None else pool.chunk_validity_ms
        wait = chunk.deny(self.now_ms(), max(1, hint), pool.chunk_validity_ms, min_cost=cost, hold_ms=self.hold_ms)
        self.metrics.pool_renewals.labels(pool.id, "alone_denied").inc()
        return Take(TakeStatus.DENIED, wait)

    def _renewal(self, spend: GlobalSpend, chunk: Chunk) -> asyncio.Future:
        """The pool's single in-flight renewal (started by the first request that needs one)."""
        pid = spend.pool.id
        fut = self._renewing.get(pid)
        if fut is None:
            fut = asyncio.ensure_future(self._renew(spend, chunk))
            self._renewing[pid] = fut
            fut.add_done_callback(lambda f, pid=pid: self._settle(pid, f))
        else:
            self.metrics.pool_waits.labels(pid).inc()
        return fut

    def _settle(self, pid: str, fut: asyncio.Future) -> None:
        self._renewing.pop(pid, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: a renewal nobody waits for any more may fail quietly

    async def _renew(self, spend: GlobalSpend, chunk: Chunk) -> Renewal:
        """Buy the next chunk: at least 1 token, as many as this agent's recent demand and the
        requests waiting for it call for (``Chunk.want``), at most max(cost, chunkMax). A deposited
        lease that starts within ``ROLLOVER_WAIT_MS`` is waited for (``until_start_s``, at most
        ``ROLLOVER_WAITS`` times) and a part that ended before it arrived is bought again (at most
        ``LATE_PARTS`` times); an empty balance waits (once) for the top-up in flight — as long
        as it takes. Requests wait within their own budgets. Store errors propagate to the waiting
        requests."""
        pool = spend.pool
        gkey = KeyBuilder.global_pool_key(pool.id)
        outcome = Renewal.ERROR
        try:
            waited_topup, rollover_waits, late_parts = False, 0, 0
            while True:
                sent_at = self.now_ms()  # validity is timed from the moment the request was sent (I5)
                want = chunk.want(spend.cost, pool.chunk_max, sent_at, pool.chunk_validity_ms)
                # capped to what the lease's remaining life can spend, but never below what the
                # requests waiting for it need now
                got = await self._pool_take(gkey, 1, want, tokens_per_s(want, pool.chunk_validity_ms),
                                            min(want, chunk.waiting))
                if got.taken:
                    validity = min(pool.chunk_validity_ms, got.valid_for_ms)
                    chunk.grant(got.taken, sent_at, validity, debits=got.debits)
                    self._arm(pool)  # its unspent rest is refunded shortly before it ends
                    if sent_at + validity <= self.now_ms() and late_parts < LATE_PARTS:
                        late_parts += 1  # ended before it arrived: bought in a lease's last moments
                        continue  # (its rest is refunded like any ended part's); the next lease pays
                    outcome = Renewal.GRANTED if got.taken >= want else Renewal.PARTIAL
                    return outcome
                if rollover_waits < ROLLOVER_WAITS and 0 < got.next_from_ms <= ROLLOVER_WAIT_MS:
                    rollover_waits += 1  # a deposited lease starts in a moment: buy from it then
                    await asyncio.sleep(until_start_s(got.next_from_ms))
                    continue
                pending = self.leases.observed(gkey, got.remaining) if self.leases is not None else None
                # the regional balance is being topped up right now: wait for it (the top-up is bounded
                # by the allocator client's deadline)
                if waited_topup or pending is None or not await topped_up(pending, None):
                    break
                waited_topup = True
            state = self.leases.state(gkey) if self.leases is not None else BalanceState.IDLE
            if state is BalanceState.UNREACHABLE and pool.fallback_per_region > 0 and spend.rule.fail_mode != "closed":
                outcome = await self._renew_from_fallback(spend, chunk, gkey)
                return outcome
            hint = self.leases.retry_hint_ms(gkey) if self.leases is not None else 0
            chunk.deny(self.now_ms(), max(int(got.next_from_ms), hint), pool.chunk_validity_ms, hold_ms=self.hold_ms)
            outcome = Renewal.DENIED
            return outcome
        finally:
            self.metrics.pool_renewals.labels(pool.id, outcome).inc()
            wasted = chunk.take_abandoned()  # what the chunk held when its parts expired (counted here:
            if wasted:  # a renewal follows a chunk's end, and the request path stays free of it)
                self.metrics.chunk_abandoned.labels(pool.id).inc(wasted)

    async def _renew_from_fallback(self, spend: GlobalSpend, chunk: Chunk, gkey: str) -> Renewal:
        """Allocator unreachable and the regional balance empty: a chunk of one request's cost
        from the region's fallback allowance, charged to every allocator window the decision may
        fall in, and valid only while the allocator's clock is surely still in the last of them."""
        pool = spend.pool
        self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "pool_fallback").inc()
        sent_at = self.now_ms()
        w = self.windows(pool)
        if w.span > MAX_SPAN:  # the allocator's clock is too uncertain to count per window
            chunk.deny(self.now_ms(), w.end_in_ms, pool.chunk_validity_ms, hold_ms=self.hold_ms)
            chunk.fallback = True
            return Renewal.FALLBACK_DENIED
        call = multi_rule_call(
            [allowance_call(KeyBuilder.pool_fallback_key(gkey), pool, w, spend.cost)],
            decision_key=KeyBuilder.global_pool_decision_key(pool.id), slack_ms=0, decision_ttl_ms=0,
            member=f"renew-fb-{pool.id}")
        (reply,) = await self.store.submit([call], wait_s=self.budget_s)
        res = parse_multi_rule(reply)
        validity = min(pool.chunk_validity_ms, w.safe_ms)
        if res.allowed and validity > 0:
            chunk.grant(spend.cost, sent_at, validity, fallback=True)
            return Renewal.FALLBACK
        chunk.deny(self.now_ms(), w.end_in_ms, pool.chunk_validity_ms, hold_ms=self.hold_ms)
        chunk.fallback = True
        return Renewal.FALLBACK_DENIED


def allowance_call(key: str, pool: Pool, w: Windows, cost: int) -> Call:
    """The multi-rule call that charges ``cost`` tokens to the region's fallback allowance of
    ``pool`` in every candidate allocator window ``w`` (kind ``pw``)."""
    ttl = w.end_in_ms + pool.window_ms  # the counts outlive every window they were charged to
    return Call(key, POOL_WINDOW.code, (pool.fallback_per_region, w.lo, w.hi, cost, ttl))
