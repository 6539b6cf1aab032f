"""What a decision's script answer means: ``outcome(plan, pools, result | error, balance)``.

Pure (no I/O, no clock, no metrics): the engine sends the plan's script call, then asks this
module what the answer means, and carries the step out (region_agent/decision/engine.py). The steps:

* ``ANSWER``: a decision, its fields in :class:`Answer` (a denial may be remembered by the
  negative cache: ``cacheable``; not a leased pool's while a top-up may still land);
* ``ALLOWED_WITHOUT_SCRIPT``: admitted, and no slot of the call reports for the decision (its
  first rule is a fleet-wide pool spent from a chunk, or nothing was selected);
* ``CONFLICT``: the request id has a decision record for another question (409);
* ``RETRY_SAME``: an ambiguous outcome of an idempotent decision: send the same call again (the
  script replays its stored answer, docs/invariants.md I6);
* ``RESEND``: the call did not run (:class:`~kernel.errors.NothingRan`: its connection failed
  before it was written — in the handshake, or in the reload after a ``NOSCRIPT``): send it
  again, once, within the same budget, with or without a decision record (nothing can be debited
  twice);
* ``DEGRADE``: the store failed; :func:`degrade` says how, per rule failMode;
* ``WAIT_TOP_UP``: a leased pool balance could not pay while a top-up may still come: wait for
  it once, send the call again and ask again with ``waited=True``;
* ``POOL_FALLBACK``: a leased pool balance could not pay and the allocator is unreachable: the
  pool's fallback allowance answers (docs/invariants.md I8: never when the pool is only exhausted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from kernel.algorithms import LocalModel, Role
from kernel.bundle import Pool, Rule
from kernel.errors import (
    AmbiguousOutcome,
    DecisionConflict,
    LeaseholdError,
    NothingRan,
    Overloaded,
    ScriptRejected,
)

from ..leasing.book import BalanceState
from ..models import DeniedScope, Reason
from .call import MultiRuleResult

if TYPE_CHECKING:  # region_agent.decision.plan builds each shape's admission parts with admission_of
    from .plan import Plan, Slot


class NextStep(Enum):
    ANSWER = "answer"
    ALLOWED_WITHOUT_SCRIPT = "allowed_without_script"
    CONFLICT = "conflict"
    RETRY_SAME = "retry_same"
    RESEND = "resend"
    DEGRADE = "degrade"
    WAIT_TOP_UP = "wait_top_up"
    POOL_FALLBACK = "pool_fallback"


class Answer(NamedTuple):
    """The fields of a decision record (the engine adds the id, the version and the HTTP answer)."""

    allowed: bool
    rule: Rule | None
    scope: DeniedScope | None = None
    reason: Reason | None = None
    limit: int | None = None
    remaining: int | None = None
    retry: int = 0
    fallback: bool = False


class Outcome(NamedTuple):
    step: NextStep
    answer: Answer | None = None
    error: LeaseholdError | None = None
    slot: int = -1  # the denying slot (0-based), for WAIT_TOP_UP / POOL_FALLBACK / a cacheable denial
    cacheable: bool = False  # a denial the negative cache may remember (no decision record)


def outcome(plan: Plan, pools: Mapping[str, Pool], result: MultiRuleResult | LeaseholdError,
            balance: BalanceState | None = None, *, can_retry: bool = False, waited: bool = False,
            fallback: bool = False, retry_floor_ms: int = 0) -> Outcome:
    """The step that follows the tenant call's ``result`` (or the error in its place).

    ``balance``: the state of the balance a denying tenant pool slot spends (None: this agent
    follows no leases, the script's denial stands); ``can_retry``: budget is left for a second
    send, and none was made yet; ``waited``: a top-up was already waited for; ``fallback``: the
    answer comes from a fallback allowance; ``retry_floor_ms``: a denial's hint is at least this
    (a positive hint)."""
    if result.__class__ is not MultiRuleResult:  # an error in the reply's place (the rare case first tested)
        if isinstance(result, DecisionConflict):
            return Outcome(NextStep.CONFLICT, error=result)
        if isinstance(result, AmbiguousOutcome) and plan.decision_ttl_ms > 0 and can_retry:
            return Outcome(NextStep.RETRY_SAME, error=result)
        if isinstance(result, NothingRan) and can_retry:  # not ambiguous: any call may go again
            return Outcome(NextStep.RESEND, error=result)
        if isinstance(result, LeaseholdError):
            return Outcome(NextStep.DEGRADE, error=result)
    res: MultiRuleResult = result
    if not res.allowed and 1 <= res.denied_by <= len(plan.slots):
        idx = res.denied_by - 1
        slot = plan.slots[idx]
        if slot.role is Role.POOL and balance is not None and not fallback:
            if balance is BalanceState.UNREACHABLE:
                return Outcome(NextStep.POOL_FALLBACK, slot=idx)
            if not waited and can_retry:
                return Outcome(NextStep.WAIT_TOP_UP, slot=idx)
        if slot.role is Role.CC:
            rule = slot.rule
            return Outcome(NextStep.ANSWER, Answer(False, rule, DeniedScope.CONCURRENCY, Reason.CONCURRENCY_EXCEEDED,
                                               rule.concurrency_max, 0, rule.concurrency_retry_after_ms, fallback))
        raw = res.remaining[idx] if idx < len(res.remaining) else 0
        retry = int(res.retry_after_ms)
        if retry >= 0:
            retry = max(retry, retry_floor_ms)
        rule = slot.rule
        answer = Answer(False, rule, DeniedScope(rule.scope), Reason.RATE_EXCEEDED, rule.limit_tokens(pools),
                        rule.remaining_tokens(int(raw)), retry, fallback)
        # a leased balance that is empty while its pool is not exhausted waits for a top-up, which
        # may land before the hint (a round trip): remembered, the denial would deny what it pays
        awaiting = slot.role is Role.POOL and not fallback and balance in (BalanceState.OK, BalanceState.IDLE)
        return Outcome(NextStep.ANSWER, answer, slot=idx, cacheable=plan.decision_ttl_ms == 0 and not awaiting)
    adm = admission(plan, pools)
    if adm is None:
        return Outcome(NextStep.ALLOWED_WITHOUT_SCRIPT)
    raw = res.remaining[adm.slot] if adm.slot < len(res.remaining) else 0
    return Outcome(NextStep.ANSWER, Answer(True, adm.rule, None, None, adm.limit, adm.rule.remaining_tokens(int(raw)),
                                           0, fallback))


class Admission(NamedTuple):
    """What an admission reports: its first selected rule, that rule's own slot (not its
    concurrency gate) in the call, whose ``remaining`` it reports, and the rule's limit."""

    slot: int
    rule: Rule
    limit: int


def admission(plan: Plan, pools: Mapping[str, Pool]) -> Admission | None:
    """The slot, rule and limit an admission of ``plan`` reports; None when no slot of the call
    reports for the decision (its first rule is a fleet-wide pool, or nothing was selected).
    Depends on the plan's shape and the snapshot's pools only (:func:`admission_of`; the
    snapshot keeps it per shape: region_agent.decision.plan.Shape.admitted)."""
    return admission_of(plan.rules, plan.slots, pools)


def admission_of(rules: Sequence[Rule], slots: Sequence[Slot], pools: Mapping[str, Pool]) -> Admission | None:
    """:func:`admission` of a plan whose enforced rules are ``rules`` and call slots ``slots``."""
    report = rules[0] if rules else None
    for i, slot in enumerate(slots):
        if slot.rule is report and slot.role is not Role.CC:
            return Admission(i, report, report.limit_tokens(pools))
    return None


# --- failMode: what answers when the store failed ------------------------------------------------
class Mode(Enum):
    SHED = "shed"  # not a store failure: this agent is overloaded (never the local allowances)
    CLOSED = "closed"  # a rule fails closed: 503
    LOCAL = "local_bounded"  # the in-process allowances decide, all or nothing
    OPEN = "open"  # admitted without a check


class Degrade(NamedTuple):
    mode: Mode
    rule: Rule | None = None  # CLOSED: the rule that closes
    reason: Reason | None = None  # CLOSED: LIMITER_UNAVAILABLE, or POLICY_ERROR after a script rejection
    local: tuple[Rule, ...] = ()  # LOCAL: the rules whose allowances decide, pool allowances first


def degrade(rules: Sequence[Rule], pools: Mapping[str, Pool], exc: LeaseholdError) -> Degrade:
    """How a decision over ``rules`` answers when the store failed with ``exc`` (docs/invariants.md
    I10: a store failure answers per rule failMode, the local answer bounded). A tenant pool rule
    without its Redis balance spends the pool's in-process allowance (fallbackPerRegion per pool
    window, per agent); with no allowance it fails closed, and so it does after a script
    rejection (a policy defect never admits a pool's tokens)."""
    if isinstance(exc, Overloaded):
        return Degrade(Mode.SHED)
    rejected = isinstance(exc, ScriptRejected)

    def allowance(r: Rule) -> int:
        pool = pools.get(r.pool_id or "")
        return pool.fallback_per_region if pool is not None else 0

    unique = list(dict.fromkeys(rules))
    for r in unique:
        if r.fail_mode == "closed" or (r.role is Role.POOL and (rejected or allowance(r) <= 0)):
            return Degrade(Mode.CLOSED, r, Reason.POLICY_ERROR if rejected else Reason.LIMITER_UNAVAILABLE)
    local = [r for r in unique if r.fail_mode == "local_bounded"
             and (r.fallback is not None or r.local_model is LocalModel.POOL_ALLOWANCE)]
    if not local:
        return Degrade(Mode.OPEN)
    return Degrade(Mode.LOCAL, local=tuple(sorted(local, key=lambda r: r.role is not Role.POOL)))


def pool_denial_slot(plan: Plan, result: MultiRuleResult | LeaseholdError) -> int | None:
    """The slot index of a tenant pool rule that denied ``result``, or None."""
    if isinstance(result, LeaseholdError) or result.allowed or not 1 <= result.denied_by <= len(plan.slots):
        return None
    idx = result.denied_by - 1
    return idx if plan.slots[idx].role is Role.POOL else None
