"""The decision engine: one admission request -> one decision record.

Flow per request (seed ch. 9, 10, 12): read the policy snapshot once; build the plan
(selected rules, keys, one multi-rule call, optional shadow call); reserve global-pool
tokens from in-process chunk leases; send the tenant call through the coalescing batcher
under one monotonic deadline; map the script result, or degrade per rule ``failMode`` on
a store failure. Driver-free: the store is reached only through :class:`StoreGateway`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernel.bundle import Bundle, Rule
from kernel.errors import (
    AmbiguousOutcome,
    DeadlineExceeded,
    LeaseholdError,
    ScriptRejected,
    StoreUnavailable,
)

from .chunks import ChunkLease
from .fallback import LocalFallback, LocalItem
from .httpmap import apply_http
from .keys import KeyBuilder
from .metrics import AgentMetrics
from .models import AdmitRequest, Decision, ReleaseRequest, RenewRequest
from .negcache import NegativeCache
from .plan import (
    Call,
    GlobalSpend,
    Plan,
    build_plan,
    cc_gates,
    cc_keys_for_release,
    memo_of,
    tokens_limit,
    tokens_remaining,
)

log = logging.getLogger("region_agent.engine")

DEGRADE_REASON = {StoreUnavailable: "STORE_UNREACHABLE", AmbiguousOutcome: "AMBIGUOUS",
                  DeadlineExceeded: "DEADLINE", ScriptRejected: "POLICY_ERROR"}


BATCH_ITEMS_PER_BUDGET = 64  # a batch gets one more decision budget per this many items


def degrade_label(exc: LeaseholdError) -> str:
    for cls, label in DEGRADE_REASON.items():
        if isinstance(exc, cls):
            return label
    return "STORE_UNREACHABLE"


@dataclass(slots=True)
class _Reservation:
    spend: GlobalSpend
    generation: int


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


class Engine:
    def __init__(self, *, get_bundle: Callable[[], Bundle], keys: KeyBuilder, store: Any, metrics: AgentMetrics,
                 fallback: LocalFallback | None = None, budget_ms: int = 50,
                 clock: Callable[[], float] = time.monotonic, leases: Any | None = None,
                 negative: NegativeCache | None = None):
        self.get_bundle = get_bundle
        self.keys = keys
        self.store = store
        self.metrics = metrics
        self.fallback = fallback if fallback is not None else LocalFallback()  # (an empty one is falsy)
        self.budget = budget_ms / 1000.0
        self.clock = clock
        self._chunks: dict[str, ChunkLease] = {}
        self._renewing: dict[str, asyncio.Future] = {}
        self.leases = leases  # region_agent.leasing.manager.LeaseManager, when the allocator is configured
        self.negative = negative if negative is not None else NegativeCache()
        self._decision_counters: dict[tuple, Any] = {}

    def now_ms(self) -> float:
        return self.clock() * 1000.0

    # ------------------------------------------------------------------ public API
    async def admit(self, req: AdmitRequest) -> Decision:
        bundle = self.get_bundle()  # one snapshot for the whole request
        plan = build_plan(bundle, req, self.keys)  # raises ValidationFailed before any key exists
        prep = await self._prepare(plan, bundle)
        if prep.early is not None:
            return self._finish(prep, prep.early)
        replies: list[Any] | LeaseholdError
        try:
            calls = self._script_calls(plan)
            replies = await self.store.submit(calls, wait_s=self._remaining(prep)) if calls else []
        except LeaseholdError as e:
            replies = e
        return await self._complete(prep, replies)

    async def admit_many(self, reqs: list[AdmitRequest]) -> list[Decision]:
        """Batch: every item's tenant call goes in one coalesced pipeline (one round trip per shard)."""
        bundle = self.get_bundle()
        plans = [build_plan(bundle, r, self.keys) for r in reqs]  # whole batch is 422 if one is malformed
        budget = self.budget * (1 + len(plans) // BATCH_ITEMS_PER_BUDGET)
        preps = [self._begin(p, bundle, budget) for p in plans]
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
        for key in cc_keys:
            await self.store.release(key, req.request_id)
        return len(cc_keys)

    async def renew(self, req: RenewRequest) -> tuple[int, int]:
        """Heartbeat (seed ch. 9): (slots extended, gates). A slot that was released or expired
        is not revived; the gateway then treats the export as unprotected or ends it."""
        gates = cc_gates(self.get_bundle(), request_tenant=req.tenant_id, principal=req.principal,
                         route_group=req.route_group, keys=self.keys)
        renewed = 0
        for key, rule in gates:
            renewed += await self.store.renew(key, req.request_id, rule.concurrency_ttl_ms)
        return renewed, len(gates)

    # ------------------------------------------------------------------ phases
    def _remaining(self, prep: _Prepared) -> float:
        return max(0.0, prep.deadline - self.clock())

    def _script_calls(self, plan: Plan) -> list[tuple[str, list, list]]:
        calls = []
        if plan.calls:
            calls.append(self.store.multi_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                               decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id))
        if plan.shadow_calls:
            calls.append(self.store.multi_call(plan.shadow_calls, decision_key=plan.decision_key,
                                               slack_ms=max(r.rule.ttl_slack_ms for r in plan.shadow_slots),
                                               decision_ttl_ms=0, member=plan.request_id))
        return calls

    async def _prepare(self, plan: Plan, bundle: Bundle, budget: float | None = None) -> _Prepared:
        prep = self._begin(plan, bundle, budget)
        if prep.early is None and plan.global_spends:
            await self._take_globals(prep)
        return prep

    def _begin(self, plan: Plan, bundle: Bundle, budget: float | None = None) -> _Prepared:
        """The synchronous part of preparing: deadline, negative cache, pool demand."""
        started = self.clock()
        prep = _Prepared(plan, bundle, started, started + (budget or self.budget), [])
        hit = self._negative_hit(prep)
        if hit is not None:
            prep.early = hit
            return prep
        self._note_pool_demand(prep)
        return prep

    async def _take_globals(self, prep: _Prepared) -> None:
        """Reserve every fleet-wide pool's tokens from in-process chunk leases, or decide early."""
        plan, bundle = prep.plan, prep.bundle
        for spend in plan.global_spends:
            status, retry = await self._take_global(spend, prep)
            if status == "denied":
                self._give_back(prep)
                prep.early = self._decision(plan, bundle, allowed=False, rule=spend.rule, scope="global",
                                            reason="RATE_EXCEEDED", limit=spend.pool.limit, remaining=0,
                                            retry=retry, fallback=prep.used_fallback)
                break
            if status == "unavailable":
                self._give_back(prep)
                prep.early = self._decision(plan, bundle, allowed=False, rule=spend.rule, scope="global",
                                            reason="LIMITER_UNAVAILABLE", retry=retry)
                break

    async def _complete(self, prep: _Prepared, replies: list[Any] | LeaseholdError) -> Decision:
        plan = prep.plan
        if not plan.calls:  # no tenant-tagged rule (e.g. only global pools, or nothing selected)
            if plan.shadow_calls and isinstance(replies, list) and replies:
                self._count_shadow(plan, replies[0])
            return self._finish(prep, self._allowed_without_script(prep))
        try:
            if isinstance(replies, LeaseholdError):
                raise replies
            if len(replies) > 1:
                self._count_shadow(plan, replies[1])
            result = self.store.parse(replies[0])
        except AmbiguousOutcome as e:
            if plan.decision_ttl_ms > 0 and self._remaining(prep) > 0:
                return await self._retry_idempotent(prep, e)
            return self._finish(prep, self._degrade(prep, e))
        except LeaseholdError as e:
            return self._finish(prep, self._degrade(prep, e))
        if not result.allowed and 1 <= result.denied_by <= len(plan.slots) \
                and plan.slots[result.denied_by - 1].role == "pool":
            return self._finish(prep, await self._pool_denied(prep, result))
        return self._finish(prep, self._from_result(prep, result))

    async def _retry_idempotent(self, prep: _Prepared, first: LeaseholdError) -> Decision:
        """Same decision id, same arguments: the script replays its stored result."""
        plan = prep.plan
        call = self.store.multi_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                     decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id)
        self.metrics.script_errors.labels("AmbiguousOutcome").inc()
        try:
            (reply,) = await self.store.submit([call], wait_s=self._remaining(prep))
            result = self.store.parse(reply)
        except LeaseholdError as e:
            return self._finish(prep, self._degrade(prep, e))
        return self._finish(prep, self._from_result(prep, result))

    # ------------------------------------------------------------------ results
    def _from_result(self, prep: _Prepared, res: Any, *, fallback: bool = False, retry_floor: int = 0,
                     calls: list[Call] | None = None) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        pools = memo_of(bundle).pools
        if not res.allowed and res.denied_by >= 1:
            idx = res.denied_by - 1
            slot = plan.slots[idx]
            self._give_back(prep)
            if slot.role == "cc":
                return self._decision(plan, bundle, allowed=False, rule=slot.rule, scope="concurrency",
                                      reason="CONCURRENCY_EXCEEDED", limit=slot.rule.concurrency_max, remaining=0,
                                      retry=slot.rule.concurrency_retry_after_ms, fallback=fallback)
            raw = res.remaining[idx] if idx < len(res.remaining) else 0
            retry = int(res.retry_after_ms)
            if retry >= 0:
                retry = max(retry, retry_floor)
            args = dict(rule=slot.rule, scope=slot.rule.scope, reason="RATE_EXCEEDED",
                        limit=tokens_limit(slot.rule, pools), remaining=tokens_remaining(slot.rule, int(raw)))
            if plan.decision_ttl_ms == 0:
                call = (calls or plan.calls)[idx]
                self.negative.put((call.key, call.params), self.now_ms(), retry, (args, fallback))
            return self._decision(plan, bundle, allowed=False, retry=retry, fallback=fallback, **args)
        report = plan.rules[0]
        for i, slot in enumerate(plan.slots):
            if slot.rule is report and slot.role != "cc":
                raw = res.remaining[i] if i < len(res.remaining) else 0
                return self._decision(plan, bundle, allowed=True, rule=report, limit=tokens_limit(report, pools),
                                      remaining=tokens_remaining(report, int(raw)), fallback=fallback)
        d = self._allowed_without_script(prep)
        d.fallback = d.fallback or fallback
        return d

    # ------------------------------------------------------------------ negative cache and leased pools
    def _negative_hit(self, prep: _Prepared) -> Decision | None:
        plan = prep.plan
        if plan.decision_ttl_ms > 0 or not len(self.negative):
            return None
        now = self.now_ms()
        for call in plan.calls:
            hit = self.negative.get((call.key, call.params), now)
            if hit is not None:
                args, fallback = hit.payload
                self.metrics.negative_hits.inc()
                return self._decision(plan, prep.bundle, allowed=False, retry=max(1, int(hit.retry_at_ms - now + 0.999)),
                                      fallback=fallback, **args)
        return None

    def _pool_slots(self, prep: _Prepared) -> list[tuple[int, Any, str, int]]:
        """(slot index, pool, balance key, tokens) of every tenant pool rule in the script call."""
        if not any(s.role == "pool" for s in prep.plan.slots):
            return []
        pools = memo_of(prep.bundle).pools
        out = []
        for i, (slot, call) in enumerate(zip(prep.plan.slots, prep.plan.calls, strict=True)):
            if slot.role == "pool" and slot.rule.pool in pools:
                out.append((i, pools[slot.rule.pool], call.key, call.params[0]))
        return out

    def _note_pool_demand(self, prep: _Prepared) -> None:
        if self.leases is None:
            return
        for _, pool, key, tokens in self._pool_slots(prep):
            self.leases.note(pool, key, tokens)

    async def _pool_denied(self, prep: _Prepared, res: Any) -> Decision:
        """The leased balance could not pay. Which answer depends on why (DESIGN invariant 6):
        a top-up in flight is waited for once; the allocator said the pool is exhausted -> a normal
        429 until the next window; the allocator is unreachable -> the pool's fallback allowance
        (or 503 for a closed rule); never the allowance when the pool is merely exhausted."""
        plan = prep.plan
        idx = res.denied_by - 1
        slot = plan.slots[idx]
        key = plan.calls[idx].key
        leases = self.leases
        if leases is None:
            return self._from_result(prep, res)
        raw = res.remaining[idx] if idx < len(res.remaining) else 0
        pending = leases.observed(key, int(raw))  # the script's view of the balance, fresher than the tick's
        # wait for a top-up only while the allocator is not known to be unreachable, and keep part of
        # the budget: the call that follows (the script again, or the fallback allowance) needs time
        # too, or it would time out and degrade as if Redis were down
        if pending is not None and not prep.pool_retried and self._remaining(prep) > 0 \
                and leases.state(key) != "unreachable":
            prep.pool_retried = True
            self.metrics.pool_waits.labels(slot.rule.pool or "?").inc()
            try:
                left = self._remaining(prep)
                await asyncio.wait_for(asyncio.shield(pending), max(left / 2, left - min(0.025, self.budget / 4)))
                (reply,) = await self.store.submit(self._script_calls(plan)[:1], wait_s=self._remaining(prep))
                again = self.store.parse(reply)
            except (TimeoutError, LeaseholdError):
                again = res
            if again.allowed or again.denied_by != res.denied_by:
                return self._from_result(prep, again)
            res = again
        state = leases.state(key)
        if state == "unreachable":
            return await self._pool_fallback(prep, res, idx)
        return self._from_result(prep, res, retry_floor=max(1, leases.retry_hint_ms(key)))

    async def _pool_fallback(self, prep: _Prepared, res: Any, idx: int) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        rule = plan.slots[idx].rule
        pool = next(p for p in bundle.pools if p.id == rule.pool)
        if rule.fail_mode == "closed" or pool.fallback_per_region <= 0:
            self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "closed").inc()
            self._give_back(prep)
            return self._decision(plan, bundle, allowed=False, rule=rule, scope=rule.scope,
                                  reason="LIMITER_UNAVAILABLE", retry=rule.closed_retry_after_ms)
        self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "pool_fallback").inc()
        original = plan.calls[idx]
        calls = list(plan.calls)
        calls[idx] = Call(KeyBuilder.pool_fallback_key(original.key), "fw",
                          (pool.fallback_per_region, pool.window_ms, original.params[0], 0, 0))
        call = self.store.multi_call(calls, decision_key=plan.decision_key + ":fb", slack_ms=plan.slack_ms,
                                     decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id)
        try:
            (reply,) = await self.store.submit([call], wait_s=self._remaining(prep))
            result = self.store.parse(reply)
        except LeaseholdError as e:
            return self._degrade(prep, e)
        return self._from_result(prep, result, fallback=True, calls=calls)

    def _allowed_without_script(self, prep: _Prepared) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        if not plan.rules:
            return self._decision(plan, bundle, allowed=True, rule=None)
        report = plan.rules[0]
        for r in prep.reservations:
            if r.spend.rule is report:
                lease = self._chunks.get(r.spend.pool.id)
                return self._decision(plan, bundle, allowed=True, rule=report, limit=r.spend.pool.limit,
                                      remaining=lease.remaining if lease else 0)
        return self._decision(plan, bundle, allowed=True, rule=report)

    def _degrade(self, prep: _Prepared, exc: LeaseholdError) -> Decision:
        plan, bundle = prep.plan, prep.bundle
        label = degrade_label(exc)
        self.metrics.script_errors.labels(type(exc).__name__).inc()
        rules: list[Rule] = []
        for s in plan.slots:
            if s.rule not in rules:
                rules.append(s.rule)
        pools = memo_of(bundle).pools

        def pool_allowance(r: Rule) -> int:
            pool = pools.get(r.pool or "")
            return pool.fallback_per_region if pool is not None else 0

        # a tenant pool rule without its Redis balance spends an in-process allowance of
        # fallbackPerRegion per pool window (per agent); with no allowance it behaves as closed
        closed = next((r for r in rules if r.fail_mode == "closed"
                       or (r.algorithm == "pool" and pool_allowance(r) <= 0)), None)
        if closed is not None:
            self.metrics.degradations.labels(label, "closed").inc()
            self._give_back(prep)
            reason = "POLICY_ERROR" if isinstance(exc, ScriptRejected) else "LIMITER_UNAVAILABLE"
            return self._decision(plan, bundle, allowed=False, rule=closed, scope=closed.scope, reason=reason,
                                  retry=closed.closed_retry_after_ms)
        local = [r for r in rules if r.fail_mode == "local_bounded" and (r.fallback is not None or r.algorithm == "pool")]
        mode = "local_bounded" if local else "open"
        self.metrics.degradations.labels(label, mode).inc()
        if not local:
            d = self._allowed_without_script(prep)
            d.fallback = True
            return d
        items = [LocalItem(plan.rule_keys.get(r.id, r.id), r, plan.cost_hint,
                           (pool_allowance(r), pools[r.pool].window_ms) if r.algorithm == "pool" else None)
                 for r in local]
        res = self.fallback.admit(items, int(self.now_ms()))
        if not res.allowed:
            self._give_back(prep)
            rule = local[res.denied_by - 1]
            return self._decision(plan, bundle, allowed=False, rule=rule, scope=rule.scope, reason="RATE_EXCEEDED",
                                  limit=_fallback_limit(rule), remaining=res.remaining[res.denied_by - 1],
                                  retry=res.retry_after_ms, fallback=True)
        report = plan.rules[0]
        if report in local:
            i = local.index(report)
            return self._decision(plan, bundle, allowed=True, rule=report, limit=_fallback_limit(report),
                                  remaining=res.remaining[i], fallback=True)
        return self._decision(plan, bundle, allowed=True, rule=report, fallback=True)

    def _decision(self, plan: Plan, bundle: Bundle, *, allowed: bool, rule: Rule | None, scope: str | None = None,
                  reason: str | None = None, limit: int | None = None, remaining: int | None = None,
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
        if d.allowed:
            outcome = "fallback_allowed" if d.fallback else "allowed"
        elif d.http_status == 503:
            outcome = "unavailable"
        else:
            outcome = "fallback_denied" if d.fallback else "denied"
        label = (outcome, d.policy_id, d.policy_version)
        counter = self._decision_counters.get(label)
        if counter is None:  # labels() validates and locks: resolve each child once
            rule = memo_of(prep.bundle).rules_by_id.get(d.policy_id) if d.policy_id else None
            if len(self._decision_counters) >= 10_000:
                self._decision_counters.clear()
            counter = self._decision_counters[label] = self.metrics.decisions.labels(
                outcome, d.policy_id or "none", str(d.policy_version), rule.route_key if rule else "none")
        counter.inc()
        self.metrics.latency.observe(max(0.0, self.clock() - prep.started))
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
            res = self.store.parse(reply)
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
        now = self.now_ms()
        for r in prep.reservations:
            lease = self._chunks.get(r.spend.pool.id)
            if lease is not None:
                lease.give_back(r.spend.cost, r.generation, now)
        prep.reservations.clear()

    def _reserve(self, spend: GlobalSpend, lease: ChunkLease, prep: _Prepared) -> tuple[str, int] | None:
        """Take ``spend`` from the held chunk (``ok``), or report the local negative cache
        (``denied``), or None when a renewal is needed."""
        now = self.now_ms()
        gen = lease.try_take(spend.cost, now)
        if gen is not None:
            prep.reservations.append(_Reservation(spend, gen))
            prep.used_fallback = prep.used_fallback or lease.fallback
            return "ok", 0
        if lease.negative(now):
            return "denied", max(1, int(lease.deny_until_ms - now))
        return None

    async def _take_global(self, spend: GlobalSpend, prep: _Prepared) -> tuple[str, int]:
        """("ok" | "denied" | "unavailable" | "open", retry ms) for one global-pool spend."""
        pool = spend.pool
        lease = self._chunks.setdefault(pool.id, ChunkLease())
        if self.leases is not None:  # demand is what requests ask for, not what chunks buy
            self.leases.note(pool, self.keys.global_pool_key(pool.id), spend.cost)
        renewals = 0
        while True:
            got = self._reserve(spend, lease, prep)
            if got is not None:
                return got
            if renewals == 2:
                break
            renewals += 1
            fut = self._renewing.get(pool.id)
            if fut is None:
                fut = asyncio.ensure_future(self._renew(spend, lease))
                self._renewing[pool.id] = fut
                fut.add_done_callback(lambda _f, pid=pool.id: self._renewing.pop(pid, None))
            else:
                self.metrics.pool_waits.labels(pool.id).inc()
            try:
                await asyncio.wait_for(asyncio.shield(fut), self._remaining(prep))
            except (TimeoutError, LeaseholdError):
                renewals = 2  # one last look at the chunk, then give up
        # the regional balance could not be reached (Redis down or too slow) and no chunk is held.
        # A local_bounded rule spends this agent's in-process allowance of fallbackPerRegion per pool
        # window — the Redis-loss term of the overshoot bound, as for tenant pool rules (seed ch. 18
        # step 13: the read path keeps answering from local allowances); otherwise 503
        mode = spend.rule.fail_mode or "closed"
        if mode == "local_bounded" and pool.fallback_per_region > 0:
            self.metrics.degradations.labels("POOL_RENEWAL_FAILED", "local_bounded").inc()
            item = LocalItem(self.keys.global_pool_key(pool.id), spend.rule, prep.plan.cost_hint,
                             (pool.fallback_per_region, pool.window_ms))
            res = self.fallback.admit([item], int(self.now_ms()))
            prep.used_fallback = True
            return ("ok", 0) if res.allowed else ("denied", max(1, res.retry_after_ms))
        self.metrics.degradations.labels("POOL_RENEWAL_FAILED", mode).inc()
        if mode == "open":
            return "open", 0
        return "unavailable", spend.rule.closed_retry_after_ms

    async def _renew_from_fallback(self, spend: GlobalSpend, lease: ChunkLease, gkey: str, sent_at: float) -> str:
        """Allocator unreachable and the regional balance empty: a chunk of one request's cost
        from the pool's regional fallback allowance (a fixed window of fallbackPerRegion)."""
        pool = spend.pool
        self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "pool_fallback").inc()
        call = self.store.multi_call(
            [Call(KeyBuilder.pool_fallback_key(gkey), "fw", (pool.fallback_per_region, pool.window_ms, spend.cost, 0, 0))],
            decision_key=self.keys.global_pool_decision_key(pool.id), slack_ms=0, decision_ttl_ms=0,
            member=f"renew-fb-{pool.id}")
        (reply,) = await self.store.submit([call], wait_s=self.budget)
        res = self.store.parse(reply)
        if res.allowed:
            lease.grant(spend.cost, sent_at, pool.chunk_validity_ms, fallback=True)
            return "fallback"
        lease.deny(self.now_ms(), int(res.retry_after_ms), pool.chunk_validity_ms)
        return "fallback_denied"

    async def _renew(self, spend: GlobalSpend, lease: ChunkLease) -> None:
        pool = spend.pool
        want = max(spend.cost, pool.chunk_max)
        sent_at = self.now_ms()  # validity timed from the moment the request was sent (I5 of DESIGN)
        outcome = "error"
        gkey = self.keys.global_pool_key(pool.id)
        waited = False
        try:
            for attempt in range(3):
                call = self.store.multi_call(
                    [_pool_call(gkey, want)],
                    decision_key=self.keys.global_pool_decision_key(pool.id), slack_ms=0, decision_ttl_ms=0,
                    member=f"renew-{pool.id}")
                (reply,) = await self.store.submit([call], wait_s=self.budget)
                res = self.store.parse(reply)
                if res.allowed:
                    validity = pool.chunk_validity_ms
                    window_end = self.leases.window_end(gkey) if self.leases is not None else None
                    if window_end is not None:  # tokens of window k are never spent in window k+1 (I5)
                        validity = min(validity, int(window_end - sent_at))
                    if validity <= 0:
                        outcome = "window_ended"
                        return
                    lease.grant(want, sent_at, validity)
                    outcome = "granted" if attempt == 0 else "partial"
                    return
                balance = int(res.remaining[0]) if res.remaining else 0
                if spend.cost <= balance < want:
                    want = balance  # partial chunk when the balance is low
                    continue
                pending = self.leases.pending(gkey) if self.leases is not None else None
                if pending is not None and not waited:
                    waited = True  # the regional balance is being topped up right now: wait once
                    try:
                        await asyncio.wait_for(asyncio.shield(pending), self.budget)
                    except (TimeoutError, LeaseholdError):
                        pass
                    continue
                state = self.leases.state(gkey) if self.leases is not None else "idle"
                if state == "unreachable" and pool.fallback_per_region > 0 and spend.rule.fail_mode != "closed":
                    outcome = await self._renew_from_fallback(spend, lease, gkey, sent_at)
                    return
                hint = self.leases.retry_hint_ms(gkey) if self.leases is not None else 0
                lease.deny(self.now_ms(), max(int(res.retry_after_ms), hint), pool.chunk_validity_ms)
                outcome = "denied"
                return
        finally:
            self.metrics.pool_renewals.labels(pool.id, outcome).inc()


def _pool_call(key: str, tokens: int) -> Call:
    return Call(key, "pool", (tokens, 0, 0, 0, 0))


def _fallback_limit(rule: Rule) -> int | None:
    fb = rule.fallback
    if fb is None:
        return None
    if fb.capacity_millis is not None:
        return fb.capacity_millis // 1000
    return fb.limit
