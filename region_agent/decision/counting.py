"""What a finished decision counts besides its telemetry (region_agent.decision.telemetry): the tokens
of global pools it admitted (the overshoot estimate's numerator, by source: lease or fallback)
and the verdicts of its shadow rules (evaluated, never enforced)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kernel.algorithms import Role
from kernel.bundle import Pool
from kernel.errors import LeaseholdError

from ..service.metrics import AgentMetrics
from .call import parse_multi_rule
from .plan import GlobalSpend, Plan

log = logging.getLogger(__name__)


def tenant_pool_slots(plan: Plan, pools: Mapping[str, Pool]) -> list[tuple[int, Pool, str, int]]:
    """(slot index, pool, balance key, tokens) of every tenant pool rule in ``plan``'s script call."""
    if not plan.has_pool:
        return []
    out = []
    for i, (slot, call) in enumerate(zip(plan.slots, plan.calls, strict=True)):
        pool_id = slot.rule.pool_id
        if slot.role is Role.POOL and pool_id is not None and pool_id in pools:
            out.append((i, pools[pool_id], call.key, call.params[0]))
    return out


def count_pool_admissions(metrics: AgentMetrics, plan: Plan, pools: Mapping[str, Pool],
                          spends: Iterable[GlobalSpend], *, fallback: bool) -> None:
    """An admission spent these pools' tokens: its tenant pool slots' and its fleet-wide ``spends``."""
    source = "fallback" if fallback else "lease"
    for _, pool, _, tokens in tenant_pool_slots(plan, pools):
        metrics.pool_admitted.labels(pool.id, source).inc(tokens)
    for spend in spends:
        metrics.pool_admitted.labels(spend.pool.id, source).inc(spend.cost)


def count_shadow(metrics: AgentMetrics, plan: Plan, reply: Any) -> None:
    """The shadow call's reply: allowed (every shadow rule), denied (by which) or an error."""
    try:
        res = parse_multi_rule(reply)
    except LeaseholdError as e:
        for s in plan.shadow_slots:
            metrics.shadow.labels(s.rule.id, "error").inc()
        log.debug("shadow evaluation failed: %s", type(e).__name__)
        return
    if res.allowed:
        for s in plan.shadow_slots:
            metrics.shadow.labels(s.rule.id, "allowed").inc()
    elif 1 <= res.denied_by <= len(plan.shadow_slots):
        metrics.shadow.labels(plan.shadow_slots[res.denied_by - 1].rule.id, "denied").inc()
