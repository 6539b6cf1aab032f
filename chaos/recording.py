"""Turn a gateway's view of an admission (the ``/v1/admit`` request and the agent's answer)
into a history ``decision`` record, using the policy bundle to know which global pools the
request spends and how many tokens.

The agent's answer does not name the pool window it spent from, so the record keeps the send and
answer times (recorder clock) and, as a hint, the window of the send time
(``floor(sent_ms / windowMs)``); the checker places the admission in the allocator-clock windows
of that interval (:func:`chaos.history.to_pool_admissions`). :func:`straddles_boundary` tells
which requests were answered in a later window than they were sent in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernel.algorithms.pool import PoolRule
from kernel.bundle import Bundle, Pool, select_rules

from .history import DecisionRec, PoolSpend


def pool_spends(bundle: Bundle, *, tenant: str | None, route_group: str, principal_type: str, has_key: bool,
                cost_hint: int, at_ms: int) -> list[PoolSpend]:
    """The pools (and tokens) a request with these attributes spends, windowed at ``at_ms``."""
    pools: dict[str, Pool] = {p.id: p for p in bundle.pools}
    out: list[PoolSpend] = []
    for rule in select_rules(bundle.rules, tenant=tenant, route_group=route_group, principal_type=principal_type,
                             has_key=has_key):
        if not isinstance(rule, PoolRule) or rule.shadow or rule.pool_id not in pools:
            continue
        pool = pools[rule.pool_id]
        out.append(PoolSpend(pool=pool.id, tokens=rule.tokens(max(1, cost_hint)), window_index=at_ms // pool.window_ms,
                             rule=rule.id))
    return out


def straddles_boundary(bundle: Bundle, pool_id: str, sent_ms: int, received_ms: int) -> bool:
    for p in bundle.pools:
        if p.id == pool_id:
            return sent_ms // p.window_ms != received_ms // p.window_ms
    return False


def decision_from_admit(request: Mapping[str, Any], answer: Mapping[str, Any], bundle: Bundle, *, region: str,
                        agent: str, sent_ms: int, received_ms: int, local: bool = False) -> DecisionRec:
    """``request``: the admission request body (camelCase, as sent); ``answer``: the agent's
    decision (camelCase). ``local`` says the agent decided from a local allowance because its
    Redis was unreachable (the caller knows from the faults it injected); otherwise the
    answer's ``fallback`` flag means the pool's regional fallback allowance was used."""
    principal = request.get("principal") or {}
    spends = pool_spends(bundle, tenant=request.get("tenantId"), route_group=str(request.get("routeGroup", "")),
                         principal_type=str(principal.get("type", "anonymous")),
                         has_key=bool(principal.get("apiKeyId")), cost_hint=int(request.get("costHint") or 1),
                         at_ms=sent_ms)
    fallback = bool(answer.get("fallback"))
    return DecisionRec(agent=agent, region=region, tenant=str(request.get("tenantId") or "-"),
                    allowed=bool(answer.get("allowed")), recorded_at_ms=received_ms, sent_at_ms=sent_ms, spends=spends,
                    fallback=fallback and not local, local=fallback and local, reason=answer.get("reason"),
                    route_group=request.get("routeGroup"), request_id=request.get("requestId"),
                    rule_id=answer.get("policyId"), limit=_int(answer.get("limit")),
                    remaining=_int(answer.get("remaining")))


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None
