"""The last step of a decision: an :class:`~region_agent.decision.outcome.Answer` as the decision record
the gateway gets, with the HTTP status, headers and problem it should send (region_agent.decision.httpmap).

Every answer - the store's, the negative cache's, a global pool's, a fallback's, an overload's,
and the admission's own before any plan (the pre-authentication new-key cap, a revocable rule
under a stale bundle: :func:`early_record`) - becomes a record here and only here.
"""

from __future__ import annotations

from typing import Any

from kernel.bundle import Bundle, Rule
from kernel.errors import DecisionConflict, to_problem

from ..models import AdmitRequest, Decision, DecisionSource, Reason
from ..service.metrics import AgentMetrics
from .call import CONFLICT
from .httpmap import apply_http
from .outcome import Answer
from .plan import Plan, Snapshot
from .telemetry import count_early

SHED_RETRY_MS = 1_000  # Retry-After of a decision shed because this agent is overloaded
# overload: this agent could not get the store's answer within the budget while the store answers
SHED = Answer(False, None, reason=Reason.OVERLOADED, retry=SHED_RETRY_MS)


def decision_record(plan: Plan, snap: Snapshot, a: Answer, metrics: AgentMetrics,
                    source: DecisionSource = DecisionSource.SCRIPT) -> Decision:
    """The record of answer ``a`` to ``plan``'s request, decided with snapshot ``snap`` by
    ``source`` (the layer that answered). A denial without a positive Retry-After (a policy
    defect, region_agent.decision.httpmap) is counted."""
    return _record(plan.request_id, plan.anonymous, snap, a, source, metrics)


def early_record(req: AdmitRequest, snap: Snapshot, a: Answer, source: DecisionSource, metrics: AgentMetrics | None,
                 *, counted: Rule, tenant: str | None) -> Decision:
    """The record of a denial the admission answers before any plan or store call (source
    ``preauth``: a new key past its source's cap; ``policy``: a revocable rule under a stale
    bundle), counted in ``metrics`` under ``counted``, the rule that answered (``a.rule`` is the
    rule the record names: None when the caller must not learn it)."""
    d = _record(req.request_id, req.principal.type == "anonymous", snap, a, source, metrics)
    if metrics is not None:
        count_early(metrics, snap, counted, d, tenant)
    return d


def _record(request_id: str, anonymous: bool, snap: Snapshot, a: Answer, source: DecisionSource,
            metrics: AgentMetrics | None) -> Decision:
    allowed = a.allowed
    d = Decision(allowed=allowed, decision_id=request_id, rule_id=a.rule.id if a.rule else None,
                 bundle_version=snap.bundle.bundle_version, denied_scope=None if allowed else a.scope,
                 reason=None if allowed else a.reason, limit=a.limit, remaining=a.remaining,
                 retry_after_ms=0 if allowed else a.retry, fallback=a.fallback, source=source)
    if apply_http(d, rule=a.rule, anonymous=anonymous, answers=snap.http) and metrics is not None:
        metrics.policy_defects.labels(a.rule.id if a.rule else "none").inc()
    return d


def admitted_reply(plan: Plan, snap: Snapshot, reply: Any) -> Decision | None:
    """The record of the multi-rule script's ``reply`` as the store sent it, when it is an
    admission as :func:`~region_agent.decision.call.parse_multi_rule` reads one (a list of at least
    four ints, the first neither 0 nor the conflict's -1) — the same record as
    :func:`decision_record` of :func:`~region_agent.decision.outcome.outcome`'s answer (a unit test
    compares them) — from the parts ``snap`` built once per plan shape (:attr:`~region_agent.decision.plan.Shape.admitted`: the reporting slot, rule and
    limit, and the count-free header parts); no result tuple made in between. None for any other
    reply (the engine's general path parses and answers it) or a plan whose shape has no parts."""
    shape = plan.shape
    parts = None if shape is None else shape.admitted
    if parts is None or reply.__class__ is not list or len(reply) < 4:
        return None
    allowed = reply[0]
    if allowed == 0 or allowed == CONFLICT:
        return None
    for x in reply:
        if x.__class__ is not int:
            return None
    slot, rule, limit, fields = parts
    rem = rule.remaining_tokens(reply[3 + slot] if slot < len(reply) - 3 else 0)
    return Decision(True, plan.request_id, rule.id, snap.bundle.bundle_version, None, None, limit, rem, 0, False, 0, 200,
                    {} if fields is None else {"RateLimit-Policy": fields[0], "RateLimit": f"{fields[1]}{rem};t=0"},
                    None)


def conflict_record(plan: Plan, bundle: Bundle) -> Decision:
    """The request id already has a decision record for another question: not admitted, not
    charged, never the stored answer (HTTP 409 for /v1/admit; a batch item carries it)."""
    _, problem = to_problem(DecisionConflict(
        "requestId already has a decision for another question (tenant, principal, route group or cost) "
        "within the decision record's lifetime; use a fresh requestId", extra={"decisionId": plan.request_id}))
    return Decision(allowed=False, decision_id=plan.request_id, rule_id=None,
                    bundle_version=bundle.bundle_version, reason=Reason.REQUEST_ID_CONFLICT, retry_after_ms=-1,
                    http_status=409, headers={}, problem=problem)
