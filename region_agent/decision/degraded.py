"""Answers given without the store's verdict: what a decision does when the store failed (per
rule failMode, region_agent.decision.outcome.degrade) and when a tenant pool rule's balance is empty with
the allocator unreachable (the pool's fallback allowance, docs/invariants.md I8).

:class:`LocalAnswers` turns those policies into answers: the in-process allowances
(region_agent.decision.fallback, all or nothing, pool allowances counted per allocator window) and the
call that charges a pool's regional fallback allowance in Redis. It counts what it did
(``degradations``, ``script_errors``, ``queue_rejections``); it never sends anything itself - the
engine sends the call and hands the answer to region_agent.decision.outcome again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from kernel.algorithms.pool import PoolRule
from kernel.algorithms.pool_window import MAX_SPAN
from kernel.bundle import Pool, Rule
from kernel.errors import AmbiguousOutcome, DeadlineExceeded, LeaseholdError, ScriptRejected, StoreUnavailable

from ..leasing.fleet_pools import allowance_call
from ..leasing.window_clock import Windows
from ..models import DeniedScope, Reason
from ..service.metrics import AgentMetrics
from .call import Call, ScriptCall, multi_rule_call
from .fallback import LocalAllowances, LocalItem, pool_item, rule_item
from .keys import KeyBuilder
from .outcome import Answer, Mode, degrade
from .plan import Plan

DEGRADE_REASON = {StoreUnavailable: "STORE_UNREACHABLE", AmbiguousOutcome: "AMBIGUOUS",
                  DeadlineExceeded: "DEADLINE", ScriptRejected: "POLICY_ERROR"}


def degrade_label(exc: LeaseholdError) -> str:
    """The ``reason`` label of a degraded decision."""
    for cls, label in DEGRADE_REASON.items():
        if isinstance(exc, cls):
            return label
    return "STORE_UNREACHABLE"


class Degraded(NamedTuple):
    """How a decision whose store failed answers: ``shed`` (overload: the stage), or ``answer``;
    neither: admitted without a check (failMode open)."""

    answer: Answer | None = None
    shed: str | None = None


class PoolAllowance(NamedTuple):
    """How a tenant pool rule answers with its balance empty and the allocator unreachable:
    ``closed`` (no allowance, or a closed rule), else the ``call`` charging the region's
    allowance (``calls``: the call's slots); neither: the allocator's clock is too uncertain to
    count per window, the script's denial stands. A denial's hint is at least ``retry_floor_ms``."""

    closed: Answer | None = None
    call: ScriptCall | None = None
    calls: list[Call] | None = None
    retry_floor_ms: int = 0


class LocalAnswers:
    def __init__(self, *, allowances: LocalAllowances, windows: Callable[[Pool], Windows], metrics: AgentMetrics,
                 now_ms: Callable[[], float]):
        self.allowances = allowances
        self.windows = windows  # the allocator windows of a pool a decision taken now may fall in
        self.metrics = metrics
        self.now_ms = now_ms

    def store_failed(self, plan: Plan, pools: Mapping[str, Pool], exc: LeaseholdError) -> Degraded:
        """The store failed ``plan``'s call with ``exc``: answer per rule failMode. Overload is not
        a store failure: it is shed, never answered from the local allowances."""
        how = degrade([s.rule for s in plan.slots], pools, exc)
        if how.mode is Mode.SHED:
            if exc.extra.get("reason") == "QUEUE_FULL":
                self.metrics.queue_rejections.inc()
                return Degraded(shed="queue_full")
            return Degraded(shed="queue")
        self.metrics.script_errors.labels(type(exc).__name__).inc()
        self.metrics.degradations.labels(degrade_label(exc), how.mode.value).inc()
        if how.mode is Mode.CLOSED:
            assert how.rule is not None
            return Degraded(Answer(False, how.rule, DeniedScope(how.rule.scope), how.reason,
                                   retry=how.rule.closed_retry_after_ms))
        if how.mode is Mode.OPEN:
            return Degraded()
        return Degraded(self.local_admit(plan, list(how.local), pools))

    def local_admit(self, plan: Plan, local: list[Rule], pools: Mapping[str, Pool]) -> Answer:
        """All of a request's local allowances or none (region_agent.decision.fallback): pool rules from
        their per-allocator-window allowances (never evicted), listed first by ``degrade``, the
        other rules from their fallback buckets."""
        items: list[LocalItem] = []
        limits: list[int] = []
        for r in local:
            if isinstance(r, PoolRule):
                pool = pools[r.pool or ""]
                w = self.windows(pool)
                item = pool_item(pool.id, w, r.tokens(plan.cost_hint), pool.fallback_per_region,
                                 w.end_in_ms + pool.window_ms)
                if item is None:  # the allocator's clock is too uncertain to count per window
                    return Answer(False, r, DeniedScope(r.scope), Reason.RATE_EXCEEDED, pool.fallback_per_region, 0,
                                  w.end_in_ms, True)
                items.append(item)
                limits.append(pool.fallback_per_region)
            else:
                items.append(rule_item(r, plan.rule_keys.get(r.id, r.id), plan.cost_hint))
                limits.append(r.fallback.limit_tokens if r.fallback else 0)
        res = self.allowances.admit(items, int(self.now_ms()))
        if not res.allowed:
            i = res.denied_by - 1
            return Answer(False, local[i], DeniedScope(local[i].scope), Reason.RATE_EXCEEDED, limits[i],
                          res.remaining[i], res.retry_after_ms, True)
        report = plan.rules[0]
        if report in local:
            i = local.index(report)
            return Answer(True, report, limit=limits[i], remaining=res.remaining[i], fallback=True)
        return Answer(True, report, fallback=True)

    def pool_allowance(self, plan: Plan, pools: Mapping[str, Pool], idx: int) -> PoolAllowance:
        """Slot ``idx``, a tenant pool rule, could not pay and the allocator is unreachable: the
        region's fallback allowance of the pool in Redis (``fallbackPerRegion`` per allocator
        window, shared by the region's agents) pays instead of the balance."""
        rule = plan.slots[idx].rule
        pool = pools[rule.pool_id or ""]
        if rule.fail_mode == "closed" or pool.fallback_per_region <= 0:
            self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "closed").inc()
            return PoolAllowance(closed=Answer(False, rule, DeniedScope(rule.scope), Reason.LIMITER_UNAVAILABLE,
                                               retry=rule.closed_retry_after_ms))
        self.metrics.degradations.labels("ALLOCATOR_UNREACHABLE", "pool_fallback").inc()
        # the region's allowance, charged to every allocator window this decision may fall in
        w = self.windows(pool)
        if w.span > MAX_SPAN:  # the allocator's clock is too uncertain to count per window: deny
            return PoolAllowance(retry_floor_ms=w.end_in_ms)
        original = plan.calls[idx]
        calls = list(plan.calls)
        calls[idx] = allowance_call(KeyBuilder.pool_fallback_key(original.key), pool, w, original.params[0])
        call = multi_rule_call(calls, decision_key=plan.decision_key + ":fb", slack_ms=plan.slack_ms,
                               decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                               question=plan.question)
        return PoolAllowance(call=call, calls=calls, retry_floor_ms=w.end_in_ms)
