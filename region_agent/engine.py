"""The decision engine: one admission request -> one decision record.

Flow per request, in one direction: read the policy snapshot once; build the plan (selected
rules, keys, one multi-rule call, optional shadow call: region_agent.plan); reserve fleet-wide
pool tokens from in-process chunk leases (region_agent.leasing.fleet_pools); send the tenant call
through the coalescing batcher under one monotonic deadline (region_agent.call); ask
:func:`region_agent.outcome.outcome` what the answer means and carry that step out (an answer,
one wait for a pool top-up, the pool's fallback allowance, or a degradation per rule failMode);
the HTTP answer is region_agent.httpmap's. Driver-free: the store is reached only through the
:class:`~region_agent.store.protocol.Store` protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernel.algorithms import Role
from kernel.algorithms.pool import PoolRule
from kernel.algorithms.pool_window import MAX_SPAN
from kernel.bundle import Bundle, Pool, Rule
from kernel.errors import (
    AmbiguousOutcome,
    DeadlineExceeded,
    DecisionConflict,
    LeaseholdError,
    ScriptRejected,
    StoreUnavailable,
    to_problem,
)

from .call import Call, MultiRuleResult, multi_rule_call, parse_multi_rule, prechecked_call
from .fallback import LocalAllowances, LocalItem, pool_item, rule_item
from .httpmap import apply_http
from .keys import KeyBuilder
from .leasing.book import BalanceState
from .leasing.fleet_pools import FleetPools, TakeStatus, allowance_call
from .leasing.window_clock import AllocatorClock, Windows
from .metrics import AgentMetrics
from .models import AdmitRequest, Decision, Reason, ReleaseRequest, RenewRequest
from .negcache import NegativeCache
from .outcome import Answer, Mode, NextStep, degrade, outcome
from .plan import (
    GlobalSpend,
    Plan,
    build_plan,
    cc_gates,
    cc_keys_for_release,
    memo_of,
)
from .store.protocol import Store
from .telemetry import DecisionTelemetry

log = logging.getLogger("region_agent.engine")

DEGRADE_REASON = {StoreUnavailable: "STORE_UNREACHABLE", AmbiguousOutcome: "AMBIGUOUS",
                  DeadlineExceeded: "DEADLINE", ScriptRejected: "POLICY_ERROR"}


BATCH_ITEMS_PER_BUDGET = 64  # a batch gets one more decision budget per this many items
SHED_RETRY_MS = 1_000  # Retry-After of a decision shed because this agent is overloaded


def degrade_label(exc: LeaseholdError) -> str:
    for cls, label in DEGRADE_REASON.items():
        if isinstance(exc, cls):
            return label
    return "STORE_UNREACHABLE"


@dataclass(slots=True)
class _Reservation:
    spend: GlobalSpend
    generation: int  # the chunk it came from (chunks.NO_CHUNK: bought alone or from an allowance)


@dataclass(slots=True)
class _Prepared:
    plan: Plan
    bundle: Bundle
    started: float
    deadline: float
    reservations: list[_Reservation]
    early: Decision | None = None  # decided before the tenant script (global pool denial, negative cache)
    used_fallback: bool = False  # a global chunk came from the pool's fallback allowance
    pool_retried: bool = False  # waited once for an in-flight lease top-up


class DecisionEngine:
    def __init__(self, *, get_bundle: Callable[[], Bundle], keys: KeyBuilder, store: Store, metrics: AgentMetrics,
                 fallback: LocalAllowances | None = None, budget_ms: int = 50,
                 clock: Callable[[], float] = time.monotonic, leases: Any | None = None,
                 negative: NegativeCache | None = None, telemetry: DecisionTelemetry | None = None,
                 wall_clock: Callable[[], float] = time.time, allocator_clock: AllocatorClock | None = None):
        self.get_bundle = get_bundle
        self.keys = keys
        self.store = store
        self.metrics = metrics
        self.fallback = fallback if fallback is not None else LocalAllowances()  # (an empty one is falsy)
        self.budget = budget_ms / 1000.0
        self.clock = clock
        self.wall_clock = wall_clock
        self.leases = leases  # region_agent.leasing.manager.LeaseManager, when the allocator is configured
        # where this process stands on the allocator's clock (pool windows as the allocator numbers them)
        self.allocator_clock = allocator_clock or (leases.clock if leases is not None else AllocatorClock())
        self.fleet = FleetPools(store=store, metrics=metrics, leases=leases, now_ms=self.now_ms,
                                windows=self.pool_windows, allowance=self.fallback, budget_s=self.budget)
        self.negative = negative if negative is not None else NegativeCache()
        # counters, latency, new keys and the bypass audit of each finished decision
        self.telemetry = telemetry or DecisionTelemetry(metrics)

    def now_ms(self) -> float:
        return self.clock() * 1000.0

    def pool_windows(self, pool: Pool) -> Windows:
        """The allocator windows of ``pool`` a decision taken now may fall in."""
        return self.allocator_clock.windows(pool.window_ms, self.now_ms(), self.wall_clock() * 1000.0)

    # ------------------------------------------------------------------ public API
    async def admit(self, req: AdmitRequest, *, decoded: bool = False) -> Decision:
        """``decoded``: ``req`` came from the strict wire decoder (its id patterns were checked)."""
        bundle = self.get_bundle()  # one snapshot for the whole request
        plan = build_plan(bundle, req, self.keys, checked=decoded)  # raises ValidationFailed before any key exists
        prep = await self._prepare(plan, bundle)
        if prep.early is not None:
            return self._finish(prep, prep.early)
        replies: list[Any] | LeaseholdError
        try:
            calls = self._script_calls(plan)
            replies = await self.store.submit(calls, wait_s=self._remaining(prep)) if calls else []
        except LeaseholdError as e:
            replies = e
        d = await self._complete(prep, replies)
        if d.reason == "REQUEST_ID_CONFLICT":  # a single request answers 409 (a batch item carries it)
            raise DecisionConflict(d.problem["detail"] if d.problem else "requestId conflict",
                                   extra={"decisionId": d.decision_id})
        return d

    async def admit_many(self, reqs: list[AdmitRequest], *, decoded: bool = False) -> list[Decision]:
        """Batch: every item's tenant call goes in one coalesced pipeline (one round trip per shard)."""
        bundle = self.get_bundle()
        keys = self.keys
        plans = [build_plan(bundle, r, keys, checked=decoded) for r in reqs]  # whole batch is 422 if one is malformed
        budget = self.budget * (1 + len(plans) // BATCH_ITEMS_PER_BUDGET)
        started = self.clock()  # one start (deadline, negative-cache time) for the whole batch
        begin = self._begin
        preps = [begin(p, bundle, budget, started) for p in plans]
        pending = [p for p in preps if p.early is None and p.plan.global_spends]
        if pending:  # only items spending fleet-wide chunk leases may wait (a renewal)
            await asyncio.gather(*(self._take_globals(p) for p in pending))
        flat: list[tuple[str, list, list]] = []
        spans: list[tuple[int, int]] = []
        failed: dict[int, LeaseholdError] = {}
        for i, prep in enumerate(preps):
            calls = []
            if prep.early is None:
                try:
                    calls = self._script_calls(prep.plan)
                except LeaseholdError as e:  # e.g. a call shape the script would refuse
                    failed[i] = e
            spans.append((len(flat), len(calls)))
            flat.extend(calls)
        all_replies: list[Any] | LeaseholdError
        try:
            all_replies = await self.store.submit(flat, wait_s=self._remaining(preps[0])) if flat else []
        except LeaseholdError as e:
            all_replies = e
        out: list[Decision] = []
        for i, (prep, (start, n)) in enumerate(zip(preps, spans, strict=True)):
            if prep.early is not None:
                out.append(self._finish(prep, prep.early))
                continue
            part: list[Any] | LeaseholdError
            if i in failed:
                part = failed[i]
            else:
                part = all_replies if isinstance(all_replies, LeaseholdError) else all_replies[start:start + n]
            out.append(await self._complete(prep, part))
        return out

    async def release(self, req: ReleaseRequest) -> int:
        bundle = self.get_bundle()
        cc_keys = cc_keys_for_release(bundle, request_tenant=req.tenant_id, principal=req.principal,
                                      route_group=req.route_group, keys=self.keys)
        deadline = self.clock() + self.budget  # the decision budget, as for an admission
        for key in cc_keys:
            await self.store.release(key, req.request_id, wait_s=max(0.0, deadline - self.clock()))
        return len(cc_keys)

    async def renew(self, req: RenewRequest) -> tuple[int, int]:
        """Heartbeat: (slots extended, gates). A slot that was released or expired
        is not revived; the gateway then treats the export as unprotected or ends it."""
        gates = cc_gates(self.get_bundle(), request_tenant=req.tenant_id, principal=req.principal,
                         route_group=req.route_group, keys=self.keys)
        deadline = self.clock() + self.budget  # the decision budget, as for a release
        renewed = 0
        for key, rule in gates:
            renewed += await self.store.renew(key, req.request_id, rule.concurrency_ttl_ms,
                                              wait_s=max(0.0, deadline - self.clock()))
        return renewed, len(gates)

    # ------------------------------------------------------------------ phases
    def _remaining(self, prep: _Prepared) -> float:
        return max(0.0, prep.deadline - self.clock())

    def _script_calls(self, plan: Plan) -> list[tuple[str, list, list]]:
        calls = []
        if plan.calls:
            if plan.argv_rules is not None:  # slots checked once per policy snapshot, selection and cost
                calls.append(prechecked_call(plan.calls, plan.argv_rules, decision_key=plan.decision_key,
                                             slack_ms=plan.slack_ms, decision_ttl_ms=plan.decision_ttl_ms,
                                             member=plan.request_id, question=plan.question))
            else:
                calls.append(multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                             decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                                             question=plan.question))
        if plan.shadow_calls:
            calls.append(multi_rule_call(plan.shadow_calls, decision_key=plan.decision_key,
                                               slack_ms=max(r.rule.ttl_slack_ms for r in plan.shadow_slots),
                                               decision_ttl_ms=0, member=plan.request_id))
        return calls

    async def _prepare(self, plan: Plan, bundle: Bundle, budget: float | None = None) -> _Prepared:
        prep = self._begin(plan, bundle, budget)
        if prep.early is None and plan.global_spends:
            await self._take_globals(prep)
        return prep

    def _begin(self, plan: Plan, bundle: Bundle, budget: float | None = None, started: float | None = None
               ) -> _Prepared:
        """The synchronous part of preparing: deadline, negative cache, pool demand. ``started``:
        the clock's reading (a batch reads it once for all its items)."""
        if started is None:
            started = self.clock()
        prep = _Prepared(plan, bundle, started, started + (budget or self.budget), [])
        if not plan.decision_ttl_ms and len(self.negative):
            hit = self._negative_hit(prep, started * 1000.0)
            if hit is not None:
                prep.early = hit
                return prep
        if self.leases is not None:
            self._note_pool_demand(prep)
        return prep

    async def _take_globals(self, prep: _Prepared) -> None:
        """Reserve every fleet-wide pool's tokens (region_agent.leasing.fleet_pools), or decide early."""
        plan, bundle = prep.plan, prep.bundle
        for spend in plan.global_spends:
            took = await self.fleet.take(spend, prep.deadline, self.clock)
            if took.status is TakeStatus.OK:
                prep.reservations.append(_Reservation(spend, took.generation))
                prep.used_fallback = prep.used_fallback or took.fallback
                continue
            if took.status is TakeStatus.OPEN:
                prep.used_fallback = True
                continue
            self._give_back(prep)
            if took.status is TakeStatus.DENIED:
                prep.early = self._decision(plan, bundle, allowed=False, rule=spend.rule, scope="global",
                                            reason=Reason.RATE_EXCEEDED, limit=spend.pool.limit, remaining=0,
                                            retry=took.retry_ms, fallback=prep.used_fallback or took.fallback)
            elif took.status is TakeStatus.SHED:
                prep.early = self._shed(prep, "pool")
            else:
                prep.early = self._decision(plan, bundle, allowed=False, rule=spend.rule, scope="global",
                                            reason=Reason.LIMITER_UNAVAILABLE, retry=took.retry_ms)
            break

    async def _complete(self, prep: _Prepared, replies: list[Any] | LeaseholdError) -> Decision:
        plan = prep.plan
        if not plan.calls:  # no tenant-tagged rule (e.g. only global pools, or nothing selected)
            if plan.shadow_calls and isinstance(replies, list) and replies:
                self._count_shadow(plan, replies[0])
            return self._finish(prep, self._allowed_without_script(prep))
        if isinstance(replies, LeaseholdError):
            result: MultiRuleResult | LeaseholdError = replies
        else:
            if len(replies) > 1:
                self._count_shadow(plan, replies[1])
            result = _parse(replies[0])
        return self._finish(prep, await self._settle(prep, result))

    async def _settle(self, prep: _Prepared, result: MultiRuleResult | LeaseholdError, *, waited: bool = False,
                      retry: bool = True, fallback: bool = False, retry_floor: int = 0,
                      calls: list[Call] | None = None) -> Decision:
        """Carry out what the tenant call's ``result`` means (region_agent.outcome). ``calls``: the
        call's slots when they differ from the plan's (the pool fallback replaces one)."""
        plan = prep.plan
        pools = memo_of(prep.bundle).pools
        can_retry = retry and self._remaining(prep) > 0
        balance: BalanceState | None = None
        pending = None
        idx = _pool_denial(plan, result) if not fallback else None
        if idx is not None and self.leases is not None:
            key = plan.calls[idx].key
            raw = result.remaining[idx] if idx < len(result.remaining) else 0  # type: ignore[union-attr]
            # the script's view of the balance, fresher than the tick's
            pending = None if waited else self.leases.observed(key, int(raw))
            balance = self.leases.state(key)
            # wait for a top-up only once, and only when one is in flight
            can_retry = can_retry and pending is not None and not prep.pool_retried
            retry_floor = max(1, self.leases.retry_hint_ms(key))
        o = outcome(plan, pools, result, balance, can_retry=can_retry, waited=waited, fallback=fallback,
                    retry_floor_ms=retry_floor)
        if o.step is NextStep.ANSWER:
            assert o.answer is not None
            if not o.answer.allowed:
                self._give_back(prep)
            if o.cacheable:
                call = (calls or plan.calls)[o.slot]
                # a bucket's or window's hint is exact; a pool's (a top-up) or a fallback's is not
                self.negative.put((call.key, call.params), self.now_ms(), o.answer.retry, o.answer,
                                  exact=plan.slots[o.slot].rule.exact_hint and not fallback)
            elif o.answer.allowed:
                self._forget_denials(plan, calls)  # a probe passed: its denial no longer holds
            return self._answer(prep, o.answer)
        if o.step is NextStep.ALLOWED_WITHOUT_SCRIPT:
            self._forget_denials(plan, calls)
            d = self._allowed_without_script(prep)
            d.fallback = d.fallback or fallback
            return d
        if o.step is NextStep.CONFLICT:
            return self._conflict(prep)
        if o.step is NextStep.RETRY_SAME:
            return await self._retry_idempotent(prep)
        if o.step is NextStep.DEGRADE:
            assert o.error is not None
            return self._degrade(prep, o.error)
        assert isinstance(result, MultiRuleResult)
        if o.step is NextStep.WAIT_TOP_UP:
            assert pending is not None
            return await self._wait_top_up(prep, result, pending, o.slot)
        return await self._pool_fallback(prep, result, o.slot)

    async def _retry_idempotent(self, prep: _Prepared) -> Decision:
        """Same decision id, same arguments: the script replays its stored result."""
        plan = prep.plan
        call = multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                               decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                               question=plan.question)
        self.metrics.script_errors.labels("AmbiguousOutcome").inc()
        try:
            (reply,) = await self.store.submit([call], wait_s=self._remaining(prep))
            result = _parse(reply)
        except LeaseholdError as e:
            result = e
        return await self._settle(prep, result, retry=False)

    def _answer(self, prep: _Prepared, a: Answer, retry: int | None = None) -> Decision:
        """The decision of answer ``a`` (``retry``: in place of its hint, e.g. a cached denial's rest)."""
        return self._decision(prep.plan, prep.bundle, allowed=a.allowed, rule=a.rule, scope=a.scope,
                              reason=a.reason, limit=a.limit, remaining=a.remaining,
                              retry=a.retry if retry is None else retry, fallback=a.fallback)

    # ------------------------------------------------------------------ negative cache and leased pools
    def _forget_denials(self, plan: Plan, calls: list[Call] | None = None) -> None:
        """Drop the cached denials of a request that got past the negative cache (none of its holds
        was running: an entry it met was a probe). Its answer was not a store denial — an admission,
        or the local fallback's decision while the store is lost — so the old denial must not answer
        the others (as a store decision, with an elapsed hint) while the probe's hold lasts."""
        if not len(self.negative) or plan.decision_ttl_ms:
            return
        for call in plan.calls:
            self.negative.forget((call.key, call.params))
        for call in calls or ():  # e.g. a pool rule's fallback allowance in place of its balance
            self.negative.forget((call.key, call.params))

    def _negative_hit(self, prep: _Prepared, now: float) -> Decision | None:
        plan = prep.plan
        for call in plan.calls:
            hit = self.negative.get((call.key, call.params), now)
            if hit is not None:
                self.metrics.negative_hits.inc()
                return self._answer(prep, hit.payload, retry=max(1, int(hit.retry_at_ms - now + 0.999)))
        return None

    def _pool_slots(self, prep: _Prepared) -> list[tuple[int, Any, str, int]]:
        """(slot index, pool, balance key, tokens) of every tenant pool rule in the script call."""
        if not prep.plan.has_pool:
            return []
        pools = memo_of(prep.bundle).pools
        out = []
        for i, (slot, call) in enumerate(zip(prep.plan.slots, prep.plan.calls, strict=True)):
            if slot.role is Role.POOL and slot.rule.pool_id in pools:
                out.append((i, pools[slot.rule.pool_id], call.key, call.params[0]))
        return out

    def _note_pool_demand(self, prep: _Prepared) -> None:
        if self.leases is None:
            return
        for _, pool, key, tokens in self._pool_slots(prep):
            self.leases.note(pool, key, tokens)

    async def _wait_top_up(self, prep: _Prepared, res: MultiRuleResult, pending: asyncio.Future,
                           idx: int) -> Decision:
        """The leased balance could not pay while a top-up is in flight: wait for it once, keeping
        part of the budget (the call that follows - the script again, or the fallback allowance -
        needs time too, or it would time out and degrade as if Redis were down), then ask again."""
        prep.pool_retried = True
        self.metrics.pool_waits.labels(prep.plan.slots[idx].rule.pool_id or "?").inc()
        again: MultiRuleResult | LeaseholdError
        try:
            left = self._remaining(prep)
            await asyncio.wait_for(asyncio.shield(pending), max(left / 2, left - min(0.025, self.budget / 4)))
            (reply,) = await self.store.submit(self._script_calls(prep.plan)[:1], wait_s=self._remaining(prep))
            again = _parse(reply)
        except (TimeoutError, LeaseholdError):
            again = res
        if isinstance(again, LeaseholdError):
            again = res
        return await self._settle(prep, again, waited=True)

    async def _pool_fallback(self, prep: _Prepared, res: Any, idx: int) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        rule = plan.slots[idx].rule
        pool = next(p for p in bundle.pools if p.id == rule.pool_id)
        if rule.fail_mode == "closed" or pool.fallback_per_region <= 0:
            self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "closed").inc()
            self._give_back(prep)
            return self._decision(plan, bundle, allowed=False, rule=rule, scope=rule.scope,
                                  reason=Reason.LIMITER_UNAVAILABLE, retry=rule.closed_retry_after_ms)
        self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "pool_fallback").inc()
        # the region's allowance, charged to every allocator window this decision may fall in
        w = self.pool_windows(pool)
        if w.span > MAX_SPAN:  # the allocator's clock is too uncertain to count per window: deny
            return await self._settle(prep, res, fallback=True, retry_floor=w.end_in_ms)
        original = plan.calls[idx]
        calls = list(plan.calls)
        calls[idx] = allowance_call(KeyBuilder.pool_fallback_key(original.key), pool, w, original.params[0])
        call = multi_rule_call(calls, decision_key=plan.decision_key + ":fb", slack_ms=plan.slack_ms,
                               decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                               question=plan.question)
        result: MultiRuleResult | LeaseholdError
        try:
            (reply,) = await self.store.submit([call], wait_s=self._remaining(prep))
            result = _parse(reply)
        except LeaseholdError as e:
            result = e
        return await self._settle(prep, result, retry=False, fallback=True, calls=calls, retry_floor=w.end_in_ms)

    def _allowed_without_script(self, prep: _Prepared) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        if not plan.rules:
            return self._decision(plan, bundle, allowed=True, rule=None)
        report = plan.rules[0]
        for r in prep.reservations:
            if r.spend.rule is report:
                return self._decision(plan, bundle, allowed=True, rule=report, limit=r.spend.pool.limit,
                                      remaining=self.fleet.remaining(r.spend.pool.id))
        return self._decision(plan, bundle, allowed=True, rule=report)

    def _degrade(self, prep: _Prepared, exc: LeaseholdError) -> Decision:
        """The store failed this decision: answer per rule failMode (region_agent.outcome.degrade).
        Overload is not a store failure: it is shed, never answered from the local allowances."""
        plan, bundle = prep.plan, prep.bundle
        pools = memo_of(bundle).pools
        how = degrade([s.rule for s in plan.slots], pools, exc)
        if how.mode is Mode.SHED:
            if exc.extra.get("reason") == "QUEUE_FULL":
                self.metrics.queue_rejections.inc()
                return self._shed(prep, "queue_full")
            return self._shed(prep, "queue")
        self._forget_denials(plan)  # a probe answered by the fallback: the store's old denial is over
        self.metrics.script_errors.labels(type(exc).__name__).inc()
        self.metrics.degradations.labels(degrade_label(exc), how.mode.value).inc()
        if how.mode is Mode.CLOSED:
            assert how.rule is not None
            self._give_back(prep)
            return self._decision(plan, bundle, allowed=False, rule=how.rule, scope=how.rule.scope,
                                  reason=how.reason, retry=how.rule.closed_retry_after_ms)
        if how.mode is Mode.OPEN:
            d = self._allowed_without_script(prep)
            d.fallback = True
            return d
        return self._local_admit(prep, list(how.local), pools)

    def _local_admit(self, prep: _Prepared, local: list[Rule], pools: dict[str, Pool]) -> Decision:
        """All of a request's local allowances or none (region_agent.fallback): pool rules from
        their per-allocator-window allowances (never evicted), listed first by ``degrade``, the
        other rules from their fallback buckets."""
        plan, bundle = prep.plan, prep.bundle
        items: list[LocalItem] = []
        limits: list[int] = []
        for r in local:
            if isinstance(r, PoolRule):
                pool = pools[r.pool or ""]
                w = self.pool_windows(pool)
                item = pool_item(pool.id, w, r.tokens(plan.cost_hint), pool.fallback_per_region,
                                 w.end_in_ms + pool.window_ms)
                if item is None:  # the allocator's clock is too uncertain to count per window
                    self._give_back(prep)
                    return self._decision(plan, bundle, allowed=False, rule=r, scope=r.scope, reason=Reason.RATE_EXCEEDED,
                                          limit=pool.fallback_per_region, remaining=0, retry=w.end_in_ms,
                                          fallback=True)
                items.append(item)
                limits.append(pool.fallback_per_region)
            else:
                items.append(rule_item(r, plan.rule_keys.get(r.id, r.id), plan.cost_hint))
                limits.append(r.fallback.limit_tokens if r.fallback else 0)
        res = self.fallback.admit(items, int(self.now_ms()))
        if not res.allowed:
            self._give_back(prep)
            i = res.denied_by - 1
            return self._decision(plan, bundle, allowed=False, rule=local[i], scope=local[i].scope,
                                  reason=Reason.RATE_EXCEEDED, limit=limits[i], remaining=res.remaining[i],
                                  retry=res.retry_after_ms, fallback=True)
        report = plan.rules[0]
        if report in local:
            i = local.index(report)
            return self._decision(plan, bundle, allowed=True, rule=report, limit=limits[i],
                                  remaining=res.remaining[i], fallback=True)
        return self._decision(plan, bundle, allowed=True, rule=report, fallback=True)

    def _shed(self, prep: _Prepared, stage: str) -> Decision:
        """Overload: this agent could not get the decision's store answer within its budget while
        the store is answering. A retriable 503 (``OVERLOADED``), counted; never a fallback."""
        self.metrics.shed.labels(stage).inc()
        self._give_back(prep)
        return self._decision(prep.plan, prep.bundle, allowed=False, rule=None, reason=Reason.OVERLOADED,
                              retry=SHED_RETRY_MS)

    def _conflict(self, prep: _Prepared) -> Decision:
        """The request id already has a decision record for another question: not admitted, not
        charged, never the stored answer (HTTP 409 for /v1/admit; a batch item carries it)."""
        self._give_back(prep)
        plan = prep.plan
        _, problem = to_problem(DecisionConflict(
            "requestId already has a decision for another question (tenant, principal, route group or cost) "
            "within the decision record's lifetime; use a fresh requestId", extra={"decisionId": plan.request_id}))
        return Decision(allowed=False, decision_id=plan.request_id, policy_id=None,
                        policy_version=prep.bundle.bundle_version, reason=Reason.REQUEST_ID_CONFLICT, retry_after_ms=-1,
                        http_status=409, headers={}, problem=problem)

    def _decision(self, plan: Plan, bundle: Bundle, *, allowed: bool, rule: Rule | None, scope: str | None = None,
                  reason: Reason | None = None, limit: int | None = None, remaining: int | None = None,
                  retry: int = 0, fallback: bool = False) -> Decision:
        d = Decision(allowed=allowed, decision_id=plan.request_id, policy_id=rule.id if rule else None,
                     policy_version=bundle.bundle_version, denied_scope=None if allowed else scope,  # type: ignore[arg-type]
                     reason=None if allowed else reason, limit=limit, remaining=remaining,  # type: ignore[arg-type]
                     retry_after_ms=0 if allowed else retry, fallback=fallback)
        if apply_http(d, rule=rule, anonymous=plan.anonymous):
            self.metrics.policy_defects.labels(rule.id if rule else "none").inc()
        return d

    def _finish(self, prep: _Prepared, d: Decision) -> Decision:
        if d.allowed and prep.used_fallback:
            d.fallback = True
        if d.allowed:
            self._count_pool_admissions(prep, d.fallback)
        self.telemetry.decided(prep.plan, prep.bundle, d, self.clock() - prep.started, now=prep.started,
                               touched_store=prep.early is None and not d.fallback and d.http_status != 503)
        return d

    def _count_pool_admissions(self, prep: _Prepared, fallback: bool) -> None:
        """Tokens of global pools this admission spent (the overshoot estimate's numerator)."""
        source = "fallback" if fallback else "lease"
        for _, pool, _, tokens in self._pool_slots(prep):
            self.metrics.pool_admitted.labels(pool.id, source).inc(tokens)
        for r in prep.reservations:
            self.metrics.pool_admitted.labels(r.spend.pool.id, source).inc(r.spend.cost)

    def _count_shadow(self, plan: Plan, reply: Any) -> None:
        try:
            res = parse_multi_rule(reply)
        except LeaseholdError as e:
            for s in plan.shadow_slots:
                self.metrics.shadow.labels(s.rule.id, "error").inc()
            log.debug("shadow evaluation failed: %s", type(e).__name__)
            return
        if res.allowed:
            for s in plan.shadow_slots:
                self.metrics.shadow.labels(s.rule.id, "allowed").inc()
        elif 1 <= res.denied_by <= len(plan.shadow_slots):
            self.metrics.shadow.labels(plan.shadow_slots[res.denied_by - 1].rule.id, "denied").inc()

    # ------------------------------------------------------------------ global pools (chunk leases)
    def _give_back(self, prep: _Prepared) -> None:
        for r in prep.reservations:
            self.fleet.give_back(r.spend, r.generation)
        prep.reservations.clear()


def _parse(reply: Any) -> MultiRuleResult | LeaseholdError:
    """The multi-rule reply in a pipeline slot as a result, or the contract error it means."""
    try:
        return parse_multi_rule(reply)
    except LeaseholdError as e:
        return e


def _pool_denial(plan: Plan, result: MultiRuleResult | LeaseholdError) -> int | None:
    """The slot index of a tenant pool rule that denied ``result``, or None."""
    if isinstance(result, LeaseholdError) or result.allowed or not 1 <= result.denied_by <= len(plan.slots):
        return None
    idx = result.denied_by - 1
    return idx if plan.slots[idx].role is Role.POOL else None
