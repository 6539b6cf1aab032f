"""The decision engine: one admission request -> one decision record.

Flow per request, in one direction:

1. **plan** - read the policy snapshot once and build the plan (selected rules, keys, one
   multi-rule call, optional shadow call: region_agent.decision.plan); a held denial may answer at once
   (region_agent.decision.denials); fleet-wide pool tokens are reserved from in-process chunks
   (region_agent.leasing.fleet_pools);
2. **script call** - the plan's calls (region_agent.decision.call.plan_calls) go through the coalescing
   batcher under one monotonic deadline (a batch: one submit, region_agent.decision.batch);
3. **outcome** - a store admission becomes its record at once, from parts built once per plan
   shape (region_agent.decision.record.admitted_reply); any other answer goes to
   :func:`region_agent.decision.outcome.outcome`, which says what it means, and the engine
   carries that step out: an answer, one wait for a pool top-up (region_agent.leasing.topup),
   the pool's fallback allowance or a degradation per rule failMode (region_agent.decision.degraded);
4. **HTTP** - the answer becomes the decision record with its HTTP answer (region_agent.decision.record).

Driver-free: the store is reached only through the :class:`~region_agent.store.protocol.Store`
protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kernel.bundle import Bundle, Pool
from kernel.errors import LeaseholdError

from ..leasing.fleet_pools import FleetPools, TakeStatus
from ..leasing.hot_chunks import ChunkReply, HotChunks, hot_config
from ..leasing.topup import ROLLOVER_WAITS, pool_denial, topped_up, wait_s
from ..leasing.window_clock import AllocatorClock, Windows
from ..models import AdmitRequest, Decision, DecisionSource, DeniedScope, Reason, ReleaseRequest, RenewRequest
from ..service.metrics import AgentMetrics
from ..store.protocol import Store
from .approx import ApproxRules, Ticket
from .batch import batch_budget_s
from .call import Call, MultiRuleResult, ScriptCall, plan_calls, result_of
from .counting import count_pool_admissions, count_shadow, tenant_pool_slots
from .degraded import LocalAnswers
from .denials import Denials
from .fallback import LocalAllowances
from .keys import KeyBuilder
from .negcache import NegativeCache
from .outcome import Answer, NextStep, Outcome, outcome, pool_denial_slot
from .plan import Admitted, GlobalSpend, Plan, Snapshot, build_plan, cc_gates, cc_keys_for_release
from .record import SHED, admitted_reply, conflict_record, decision_record
from .telemetry import DecisionTelemetry


class _Reservation(msgspec.Struct):
    spend: GlobalSpend
    generation: int  # the chunk it came from (chunks.NO_CHUNK: bought alone or from an allowance)


class _Prepared(msgspec.Struct):
    plan: Plan
    snap: Snapshot
    started: float
    deadline: float
    reservations: list[_Reservation]
    early: Decision | None = None  # decided before the tenant script (global pool denial, negative cache)
    used_fallback: bool = False  # a global chunk came from the pool's fallback allowance
    pool_retried: bool = False  # waited once for an in-flight lease top-up
    start_waits: int = 0  # waits for a held lease's start after that (region_agent.leasing.topup.pool_denial)
    edge: bool = False  # the pre-authentication stage of an authenticated request (Plan.edge)
    chunk: bool = False  # admitted from a hot key set's chunk (region_agent.leasing.hot_chunks): no store call
    approx: list[Ticket] | None = None  # units counted on approximate rules (given back on a denial)

    @property
    def bundle(self) -> Bundle:
        return self.snap.bundle


_NO_CALLS = (0, 0)  # an item of a batch decided before the store (its span is never read)


class DecisionEngine:
    def __init__(self, *, get_snapshot: Callable[[], Snapshot], keys: KeyBuilder, store: Store, metrics: AgentMetrics,
                 fallback: LocalAllowances | None = None, budget_ms: int = 50,
                 clock: Callable[[], float] = time.monotonic, leases: Any | None = None,
                 negative: NegativeCache | None = None, telemetry: DecisionTelemetry | None = None,
                 wall_clock: Callable[[], float] = time.time, allocator_clock: AllocatorClock | None = None,
                 decision_log: Any = None, snapshot_for: Callable[[str | None], Snapshot] | None = None,
                 cold_wait_ms: int = 0):
        self.get_snapshot = get_snapshot
        # the snapshot one request of a tenant is evaluated against (a canary slice); None: get_snapshot's
        self.snapshot_for = snapshot_for
        self.keys = keys
        self.store = store
        self.metrics = metrics
        self.fallback = fallback if fallback is not None else LocalAllowances()  # (an empty one is falsy)
        self.budget = budget_ms / 1000.0
        # how long beyond its budget a decision may wait for the first lease of a cold pool balance
        self.cold_wait = cold_wait_ms / 1000.0
        self.clock = clock
        self.wall_clock = wall_clock
        self.leases = leases  # region_agent.leasing.manager.LeaseManager, when the allocator is configured
        # where this process stands on the allocator's clock (pool windows as the allocator numbers them)
        self.allocator_clock = allocator_clock or (leases.clock if leases is not None else AllocatorClock())
        self.negative = negative if negative is not None else NegativeCache()
        self.fleet = FleetPools(store=store, metrics=metrics, leases=leases, now_ms=self.now_ms,
                                windows=self.pool_windows, allowance=self.fallback, budget_s=self.budget,
                                hold_ms=self.negative.cap_ms)
        if leases is not None:  # a lease this agent deposits lifts its own chunk's hold on that pool
            leases.on_refill(self.fleet.refilled)
        # chunks of hot key sets (rules with hotChunk; region_agent.leasing.hot_chunks)
        self.hot = HotChunks(store=store, metrics=metrics, now_ms=self.now_ms)
        self.local = LocalAnswers(allowances=self.fallback, windows=self.pool_windows, metrics=metrics,
                                  now_ms=self.now_ms)
        self.denials = Denials(self.negative, metrics, self.now_ms)
        # counters, latency, new keys and the bypass audit of each finished decision
        self.telemetry = telemetry or DecisionTelemetry(metrics)
        self.decision_log = decision_log  # region_agent.service.decision_log.DecisionLog; None: off (the default)
        # approximate rules: in-process counters reconciled with Redis (region_agent.decision.approx)
        self.approx = ApproxRules(store, clock=clock, wall_clock=wall_clock)

    def now_ms(self) -> float:
        return self.clock() * 1000.0

    def pool_windows(self, pool: Pool) -> Windows:
        """The allocator windows of ``pool`` a decision taken now may fall in."""
        return self.allocator_clock.windows(pool.window_ms, self.now_ms(), self.wall_clock() * 1000.0)

    # ------------------------------------------------------------------ public API
    async def admit(self, req: AdmitRequest, *, decoded: bool = False) -> Decision:
        """``decoded``: ``req`` came from the strict wire decoder (its id patterns were checked)."""
        # one snapshot for the whole request (with a canary staged: the candidate when it is in the slice)
        snap = self.get_snapshot() if self.snapshot_for is None else self.snapshot_for(req.tenant_id)
        plan = build_plan(snap, req, self.keys, checked=decoded)  # raises ValidationFailed before any key exists
        if plan.edge is not None:  # the address window first: a denial there is the request's answer
            (stage1,) = await self._decide_plans([plan.edge], [snap], edge=True)
            if not stage1.allowed:
                return stage1
        prep = self._begin(plan, snap)
        if prep.early is None and plan.global_spends:
            await self._take_globals(prep)
        if prep.early is not None:
            return self._finish(prep, prep.early)
        replies: list[Any] | LeaseholdError
        try:
            calls = plan_calls(plan)
        except LeaseholdError as e:
            replies = e
        else:  # :meth:`_submit` inline, and no coroutine for the completion unless it must wait
            try:
                # a key set that may be served from a chunk (a shape's hot config first: most have none)
                if calls and plan.shape is not None and plan.shape.hot is not None and hot_config(plan) is not None:
                    replies = await self.hot.ask(plan, calls, prep.deadline, self.clock)
                    prep.chunk = replies[0].__class__ is ChunkReply
                else:  # (the budget left: _remaining inline)
                    replies = await self.store.submit(calls, wait_s=max(0.0, prep.deadline - self.clock())) if calls else []
            except LeaseholdError as e:
                replies = e
        got = self._complete_now(prep, replies)
        # a conflict is a decision like any other (region_agent.decision.admission: only /v1/admit makes it a 409)
        return got if isinstance(got, Decision) else self._finish(prep, await self._settle_later(prep, got[0], *got[1]))

    async def admit_many(self, reqs: list[AdmitRequest], *, decoded: bool = False) -> list[Decision]:
        """Batch: every item's tenant call goes in one coalesced pipeline (one round trip per shard)."""
        keys = self.keys
        snapshot_for = self.snapshot_for
        snaps = [self.get_snapshot()] * len(reqs) if snapshot_for is None else [snapshot_for(r.tenant_id) for r in reqs]
        plans = [build_plan(s, r, keys, checked=decoded)  # whole batch is 422 if one is malformed
                 for s, r in zip(snaps, reqs, strict=True)]
        staged = [i for i, p in enumerate(plans) if p.edge is not None]
        if not staged:
            return await self._decide_plans(plans, snaps)
        # the address window of the items that have one first; the denied ones are answered by it
        out: list[Decision | None] = [None] * len(plans)
        firsts = await self._decide_plans([plans[i].edge for i in staged],  # type: ignore[misc]  # staged items all have an edge plan
                                          [snaps[i] for i in staged], edge=True)
        for i, d in zip(staged, firsts, strict=True):
            if not d.allowed:
                out[i] = d
        rest = [i for i in range(len(plans)) if out[i] is None]
        if rest:
            decided = await self._decide_plans([plans[i] for i in rest], [snaps[i] for i in rest])
            for i, d in zip(rest, decided, strict=True):
                out[i] = d
        return out  # type: ignore[return-value]  # every slot filled by one of the two loops

    async def _decide_plans(self, plans: list[Plan], snaps: list[Snapshot], *, edge: bool = False) -> list[Decision]:
        """The decisions of ``plans`` (one coalesced pipeline), each under its own snapshot; ``edge``:
        they are pre-authentication stages (an admission there is not the request's decision: not
        counted)."""
        budget = batch_budget_s(self.budget, len(plans))
        started = self.clock()  # one start (deadline, negative-cache time) for the whole batch
        begin = self._begin
        preps = [begin(p, s, budget, started) for p, s in zip(plans, snaps, strict=True)]
        if edge:
            for p in preps:
                p.edge = True
        pending = [p for p in preps if p.early is None and p.plan.global_spends]
        if pending:  # only items spending fleet-wide chunks may wait (a renewal)
            await asyncio.gather(*(self._take_globals(p) for p in pending))
        # every item's script calls in one list (one submit), the replies sliced back to the items:
        # per item, where its calls start and end in it, or what stands for its replies (a hot key
        # set's chunk paid it: its reply; its calls could not be built: the error; decided early: unused)
        calls: list[ScriptCall] = []
        parts: list[tuple[int, int] | list[Any] | LeaseholdError] = []
        for prep in preps:
            if prep.early is not None:
                parts.append(_NO_CALLS)
                continue
            plan = prep.plan
            shape = plan.shape
            if shape is not None and shape.hot is not None and hot_config(plan) is not None:  # (as admit)
                got = self.hot.pay(plan)
                if got is not None:
                    prep.chunk = True
                    parts.append([got])
                    continue
            try:
                mine = plan_calls(plan)
            except LeaseholdError as e:  # e.g. a call shape the script would refuse
                parts.append(e)
                continue
            start = len(calls)
            calls += mine
            parts.append((start, len(calls)))
        replies = await self._submit(preps[0], calls) if calls else []
        out: list[Decision] = []
        for prep, part in zip(preps, parts, strict=True):
            if prep.early is not None:
                out.append(self._finish(prep, prep.early))
                continue
            if isinstance(part, tuple):
                part = replies if isinstance(replies, LeaseholdError) else replies[part[0]:part[1]]
            done = self._complete_now(prep, part)
            if isinstance(done, Decision):
                out.append(done)
            else:  # another store call or a wait (a retry, a pool top-up, the pool fallback)
                out.append(self._finish(prep, await self._settle_later(prep, done[0], *done[1])))
        return out

    async def release(self, req: ReleaseRequest) -> tuple[int, int]:
        """(slots freed, gates): a slot never taken, already released or expired frees nothing."""
        snap = self.get_snapshot() if self.snapshot_for is None else self.snapshot_for(req.tenant_id)
        cc_keys = cc_keys_for_release(snap, request_tenant=req.tenant_id, principal=req.principal,
                                      route_group=req.route_group, keys=self.keys)
        deadline = self.clock() + self.budget  # the decision budget, as for an admission
        released = 0
        for key in cc_keys:
            released += await self.store.release(key, req.request_id, wait_s=max(0.0, deadline - self.clock()))
        return released, len(cc_keys)

    async def renew(self, req: RenewRequest) -> tuple[int, int]:
        """Heartbeat: (slots extended, gates). A slot that was released or expired
        is not revived; the gateway then treats the export as unprotected or ends it."""
        snap = self.get_snapshot() if self.snapshot_for is None else self.snapshot_for(req.tenant_id)
        gates = cc_gates(snap, request_tenant=req.tenant_id, principal=req.principal,
                         route_group=req.route_group, keys=self.keys)
        deadline = self.clock() + self.budget  # the decision budget, as for a release
        renewed = 0
        for key, rule in gates:
            renewed += await self.store.renew(key, req.request_id, rule.concurrency_ttl_ms,
                                              wait_s=max(0.0, deadline - self.clock()))
        return renewed, len(gates)

    # ------------------------------------------------------------------ 1. plan
    def _begin(self, plan: Plan, snap: Snapshot, budget: float | None = None, started: float | None = None
               ) -> _Prepared:
        """The synchronous part of preparing: deadline, negative cache, pool demand. ``started``:
        the clock's reading (a batch reads it once for all its items)."""
        if started is None:
            started = self.clock()
        prep = _Prepared(plan, snap, started, started + (budget or self.budget), [])
        held = self.denials.hit(plan, started * 1000.0)
        if held is not None:
            prep.early = self._answer(prep, held, DecisionSource.NEGATIVE_CACHE)
            return prep
        if plan.approx:  # approximate rules first: counted in process, a denial there needs no store call
            tickets, denied = self.approx.take(plan.approx, plan.cost_hint)
            if denied is not None:
                prep.early = self._answer(prep, denied, DecisionSource.APPROXIMATE)
                return prep
            prep.approx = tickets
        if self.leases is not None:
            for _, pool, key, tokens in tenant_pool_slots(plan, snap.pools):
                self.leases.note(pool, key, tokens)
        return prep

    async def _take_globals(self, prep: _Prepared) -> None:
        """Reserve every fleet-wide pool's tokens (region_agent.leasing.fleet_pools), or decide early."""
        for spend in prep.plan.global_spends:
            if self.cold_wait > 0 and self.fleet.remaining(spend.pool.id) < spend.cost:  # (a held chunk pays)
                self._allow_cold_wait(prep, KeyBuilder.global_pool_key(spend.pool.id))
            took = await self.fleet.take(spend, prep.deadline, self.clock)
            if took.status is TakeStatus.OK:
                prep.reservations.append(_Reservation(spend, took.generation))
                prep.used_fallback = prep.used_fallback or took.fallback
                continue
            if took.status is TakeStatus.OPEN:
                prep.used_fallback = True
                continue
            if took.status is TakeStatus.DENIED:
                prep.early = self._answer(prep, Answer(False, spend.rule, DeniedScope.GLOBAL, Reason.RATE_EXCEEDED,
                                                       spend.pool.limit, 0, took.retry_ms,
                                                       prep.used_fallback or took.fallback),
                                          DecisionSource.POOL_FALLBACK if took.fallback else DecisionSource.CHUNK)
            elif took.status is TakeStatus.SHED:
                prep.early = self._shed(prep, "pool")
            else:
                prep.early = self._answer(prep, Answer(False, spend.rule, DeniedScope.GLOBAL,
                                                       Reason.LIMITER_UNAVAILABLE, retry=took.retry_ms),
                                          DecisionSource.FAIL_CLOSED)
            break

    def _allow_cold_wait(self, prep: _Prepared, key: str) -> None:
        """A pool balance that holds no lease yet (its first use, or again after an idle spell: an
        idle balance buys no leases) while the allocator answers: the decision may wait for that
        one top-up's round trip up to ``cold_wait`` beyond its budget. The first request after a
        quiet spell is then slower instead of denied as pool-busy; a balance that holds a lease,
        is exhausted or cannot reach the allocator keeps the plain budget."""
        if self.cold_wait > 0 and self.leases is not None and self.leases.cold(key):
            prep.deadline = max(prep.deadline, self.clock() + self.cold_wait)

    # ------------------------------------------------------------------ 2. script call
    def _remaining(self, prep: _Prepared) -> float:
        return max(0.0, prep.deadline - self.clock())

    async def _submit(self, prep: _Prepared, calls: list[ScriptCall]) -> list[Any] | LeaseholdError:
        """The store's replies to ``calls`` within ``prep``'s budget, or the error in their place."""
        if not calls:
            return []
        try:
            return await self.store.submit(calls, wait_s=self._remaining(prep))
        except LeaseholdError as e:
            return e

    async def _send_one(self, prep: _Prepared, call: ScriptCall) -> MultiRuleResult | LeaseholdError:
        replies = await self._submit(prep, [call])
        return replies if isinstance(replies, LeaseholdError) else result_of(replies[0])

    # ------------------------------------------------------------------ 3. outcome
    def _complete_now(self, prep: _Prepared, replies: list[Any] | LeaseholdError
                      ) -> Decision | tuple[MultiRuleResult | LeaseholdError, tuple[Outcome, Any]]:
        """:meth:`admit`'s completion as far as it goes without waiting: the finished decision (the common
        case: no coroutine per item of a batch), or what :meth:`_settle_later` must carry out."""
        plan = prep.plan
        if not plan.calls:  # no tenant-tagged rule (e.g. only global pools, or nothing selected)
            if plan.shadow_calls and isinstance(replies, list) and replies:
                count_shadow(self.metrics, plan, replies[0])
            return self._finish(prep, self._allowed_without_script(prep))
        if isinstance(replies, LeaseholdError):
            result: MultiRuleResult | LeaseholdError = replies
        else:
            if len(replies) > 1:
                count_shadow(self.metrics, plan, replies[1])
            reply = replies[0]
            # the common case: the store admitted; its record straight from the reply and the parts of the
            # plan's shape (no result tuple in between)
            d = admitted_reply(plan, prep.snap, reply)
            if d is not None:
                self.denials.forget(plan)  # as _settle_now: a probe passed, its held denial is over
                return self._finish(prep, d, plan.shape.admitted)  # type: ignore[union-attr]  # a record was made: the plan has a shape with parts
            result = result_of(reply)  # anything else (a denial, an error, a shape without parts): the general path
        got = self._settle_now(prep, result)
        if isinstance(got, Decision):
            return self._finish(prep, got)
        return result, got

    async def _settle(self, prep: _Prepared, result: MultiRuleResult | LeaseholdError, *, waited: bool = False,
                      retry: bool = True, fallback: bool = False, retry_floor: int = 0,
                      calls: list[Call] | None = None) -> Decision:
        """Carry out what the tenant call's ``result`` means (region_agent.decision.outcome). ``calls``: the
        call's slots when they differ from the plan's (the pool fallback replaces one)."""
        got = self._settle_now(prep, result, waited=waited, retry=retry, fallback=fallback,
                               retry_floor=retry_floor, calls=calls)
        if isinstance(got, Decision):
            return got
        return await self._settle_later(prep, result, *got)

    def _settle_now(self, prep: _Prepared, result: MultiRuleResult | LeaseholdError, *, waited: bool = False,
                    retry: bool = True, fallback: bool = False, retry_floor: int = 0,
                    calls: list[Call] | None = None) -> Decision | tuple[Outcome, Any]:
        """The steps of :meth:`_settle` that need no store call or wait: a decision, or the
        outcome (and the pool denial) :meth:`_settle_later` carries out."""
        plan = prep.plan
        denial = None
        idx = pool_denial_slot(plan, result) if not fallback else None
        if idx is not None and self.leases is not None:
            raw = result.remaining[idx] if idx < len(result.remaining) else 0  # type: ignore[union-attr]  # a slot is found only in a MultiRuleResult
            starts_in = int(result.retry_after_ms)  # type: ignore[union-attr]  # as above
            left = self._remaining(prep)
            denial = pool_denial(self.leases, plan.calls[idx].key, raw, waited=waited, starts_in_ms=max(0, starts_in),
                                 within_ms=wait_s(left, self.budget) * 1000.0)
            if denial.pending is not None and not prep.pool_retried:
                self._allow_cold_wait(prep, plan.calls[idx].key)
            # wait for a top-up only once, and only when one is in flight; after it, for a held lease's
            # start within the budget (at most ROLLOVER_WAITS times)
            can_retry = retry and left > 0 and denial.pending is not None \
                and (not prep.pool_retried or (denial.starting and prep.start_waits < ROLLOVER_WAITS))
            retry_floor = denial.retry_floor_ms
            if can_retry and denial.starting:
                waited = False  # a wait for a lease's start, not a second top-up
        else:
            can_retry = retry and self._remaining(prep) > 0
        o = outcome(plan, prep.snap.pools, result, denial.balance if denial else None,
                    can_retry=can_retry, waited=waited, fallback=fallback, retry_floor_ms=retry_floor)
        if o.step is NextStep.ANSWER:
            assert o.answer is not None
            if o.cacheable:
                self.denials.remember(plan, o.slot, o.answer, calls=calls, fallback=fallback)
            elif o.answer.allowed:
                self.denials.forget(plan, calls)  # a probe passed: its denial no longer holds
            return self._answer(prep, o.answer, DecisionSource.POOL_FALLBACK if fallback else DecisionSource.SCRIPT)
        if o.step is NextStep.ALLOWED_WITHOUT_SCRIPT:
            self.denials.forget(plan, calls)
            d = self._allowed_without_script(prep)
            d.fallback = d.fallback or fallback
            if fallback:
                d.source = DecisionSource.POOL_FALLBACK
            return d
        if o.step is NextStep.CONFLICT:
            self._give_back(prep)
            return conflict_record(plan, prep.bundle)
        if o.step is NextStep.DEGRADE:
            assert o.error is not None
            return self._degrade(prep, o.error)
        return o, denial

    async def _settle_later(self, prep: _Prepared, result: MultiRuleResult | LeaseholdError, o: Outcome,
                            denial: Any) -> Decision:
        """The steps of an outcome that send another call or wait (region_agent.decision.outcome.NextStep)."""
        if o.step is NextStep.RETRY_SAME or o.step is NextStep.RESEND:
            # the same call once more, counted as what its failure was: ambiguous (same decision id, same
            # arguments: the script replays its record) or one that did not run
            self.metrics.script_errors.labels("AmbiguousOutcome" if o.step is NextStep.RETRY_SAME else "NothingRan").inc()
            return await self._settle(prep, await self._send_one(prep, plan_calls(prep.plan)[0]), retry=False)
        assert isinstance(result, MultiRuleResult)
        if o.step is NextStep.WAIT_TOP_UP:
            assert denial is not None and denial.pending is not None
            return await self._wait_top_up(prep, result, denial.pending, o.slot)
        return await self._pool_fallback(prep, result, o.slot)

    async def _wait_top_up(self, prep: _Prepared, res: MultiRuleResult, pending: Any, idx: int) -> Decision:
        """The leased balance could not pay while a top-up is in flight: wait for it once (keeping
        part of the budget for the call that follows, region_agent.leasing.topup), then ask again.
        ``pending`` may also be a held lease's start (then after a top-up's wait too, at most
        ``ROLLOVER_WAITS`` times: region_agent.leasing.topup.pool_denial)."""
        if prep.pool_retried:
            prep.start_waits += 1
        prep.pool_retried = True
        self.metrics.pool_waits.labels(prep.plan.slots[idx].rule.pool_id or "?").inc()
        again: MultiRuleResult | LeaseholdError = res
        if await topped_up(pending, wait_s(self._remaining(prep), self.budget)):
            again = await self._send_one(prep, plan_calls(prep.plan)[0])
        return await self._settle(prep, res if isinstance(again, LeaseholdError) else again, waited=True)

    async def _pool_fallback(self, prep: _Prepared, res: MultiRuleResult, idx: int) -> Decision:
        """The allocator is unreachable and slot ``idx``'s balance is empty (region_agent.decision.degraded)."""
        fb = self.local.pool_allowance(prep.plan, prep.snap.pools, idx)
        if fb.closed is not None:
            return self._answer(prep, fb.closed, DecisionSource.FAIL_CLOSED)
        if fb.call is None:  # the allocator's clock is too uncertain: the script's denial stands
            return await self._settle(prep, res, fallback=True, retry_floor=fb.retry_floor_ms)
        return await self._settle(prep, await self._send_one(prep, fb.call), retry=False, fallback=True,
                                  calls=fb.calls, retry_floor=fb.retry_floor_ms)

    def _degrade(self, prep: _Prepared, exc: LeaseholdError) -> Decision:
        """The store failed this decision: answer per rule failMode (region_agent.decision.degraded)."""
        got = self.local.store_failed(prep.plan, prep.snap.pools, exc)
        if got.shed is not None:
            return self._shed(prep, got.shed)
        self.denials.forget(prep.plan)  # a probe answered by the fallback: the store's old denial is over
        if got.answer is not None:
            closed = got.answer.reason is Reason.LIMITER_UNAVAILABLE
            return self._answer(prep, got.answer, DecisionSource.FAIL_CLOSED if closed else DecisionSource.LOCAL_FALLBACK)
        d = self._allowed_without_script(prep)  # failMode open
        d.fallback = True
        d.source = DecisionSource.FAIL_OPEN
        return d

    def _allowed_without_script(self, prep: _Prepared) -> Decision:
        plan = prep.plan
        report = plan.rules[0] if plan.rules else None
        for r in prep.reservations:
            if r.spend.rule is report:
                return self._answer(prep, Answer(True, report, limit=r.spend.pool.limit,
                                                 remaining=self.fleet.remaining(r.spend.pool.id)),
                                    DecisionSource.POOL_FALLBACK if prep.used_fallback else DecisionSource.CHUNK)
        return self._answer(prep, Answer(True, report),
                            DecisionSource.CHUNK if prep.reservations else DecisionSource.POLICY)

    def _shed(self, prep: _Prepared, stage: str) -> Decision:
        """Overload: this agent could not get the decision's store answer within its budget while
        the store is answering. A retriable 503 (``OVERLOADED``), counted; never a fallback."""
        self.metrics.shed.labels(stage).inc()
        return self._answer(prep, SHED, DecisionSource.OVERLOAD)

    # ------------------------------------------------------------------ 4. HTTP
    def _answer(self, prep: _Prepared, a: Answer, source: DecisionSource = DecisionSource.SCRIPT) -> Decision:
        """The decision record of ``a`` made by ``source``; a denial gives the reserved global pool
        tokens back."""
        if not a.allowed:
            self._give_back(prep)
        return decision_record(prep.plan, prep.snap, a, self.metrics, source)

    def _finish(self, prep: _Prepared, d: Decision, admitted: Admitted | None = None) -> Decision:
        """``admitted``: ``d`` is the store's admission made from these parts of the plan's shape
        (region_agent.decision.record.admitted_reply): the telemetry counts it by them."""
        if prep.edge and d.allowed:
            return d  # a passed address window: the request's own decision follows (and is counted)
        if d.allowed and prep.used_fallback:
            d.fallback = True
        if prep.chunk and d.allowed:
            d.source = DecisionSource.CHUNK
        if d.allowed and (prep.reservations or prep.plan.has_pool):
            count_pool_admissions(self.metrics, prep.plan, prep.snap.pools,
                                  (r.spend for r in prep.reservations), fallback=d.fallback)
        self.telemetry.decided(prep.plan, prep.snap, d, self.clock() - prep.started, now=prep.started,
                               touched_store=prep.early is None and not d.fallback and d.http_status != 503
                               and not prep.chunk,
                               admitted=admitted if not (prep.chunk or prep.used_fallback) else None)
        if self.decision_log is not None:
            self.decision_log.decided(prep.plan, prep.bundle, d)
        return d

    def _give_back(self, prep: _Prepared) -> None:
        if prep.approx:
            self.approx.give_back(prep.approx)
            prep.approx = None
        for r in prep.reservations:
            self.fleet.give_back(r.spend, r.generation)
        prep.reservations.clear()
