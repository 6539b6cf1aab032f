"""The last step of a decision: an :class:`~region_agent.outcome.Answer` as the decision record
the gateway gets, with the HTTP status, headers and problem it should send (region_agent.httpmap).

Every answer of the engine - the store's, the negative cache's, a global pool's, a fallback's,
an overload's - becomes a record here and only here.
"""

from __future__ import annotations

from kernel.bundle import Bundle
from kernel.errors import DecisionConflict, to_problem

from .httpmap import apply_http
from .metrics import AgentMetrics
from .models import Decision, Reason
from .outcome import Answer
from .plan import Plan

SHED_RETRY_MS = 1_000  # Retry-After of a decision shed because this agent is overloaded
# overload: this agent could not get the store's answer within the budget while the store answers
SHED = Answer(False, None, reason=Reason.OVERLOADED, retry=SHED_RETRY_MS)


def decision_record(plan: Plan, bundle: Bundle, a: Answer, metrics: AgentMetrics) -> Decision:
    """The record of answer ``a`` to ``plan``'s request, decided with ``bundle``. A denial without
    a positive Retry-After (a policy defect, region_agent.httpmap) is counted."""
    allowed = a.allowed
    d = Decision(allowed=allowed, decision_id=plan.request_id, policy_id=a.rule.id if a.rule else None,
                 policy_version=bundle.bundle_version, denied_scope=None if allowed else a.scope,
                 reason=None if allowed else a.reason, limit=a.limit, remaining=a.remaining,
                 retry_after_ms=0 if allowed else a.retry, fallback=a.fallback)
    if apply_http(d, rule=a.rule, anonymous=plan.anonymous):
        metrics.policy_defects.labels(a.rule.id if a.rule else "none").inc()
    return d


def conflict_record(plan: Plan, bundle: Bundle) -> Decision:
    """The request id already has a decision record for another question: not admitted, not
    charged, never the stored answer (HTTP 409 for /v1/admit; a batch item carries it)."""
    _, problem = to_problem(DecisionConflict(
        "requestId already has a decision for another question (tenant, principal, route group or cost) "
        "within the decision record's lifetime; use a fresh requestId", extra={"decisionId": plan.request_id}))
    return Decision(allowed=False, decision_id=plan.request_id, policy_id=None,
                    policy_version=bundle.bundle_version, reason=Reason.REQUEST_ID_CONFLICT, retry_after_ms=-1,
                    http_status=409, headers={}, problem=problem)
