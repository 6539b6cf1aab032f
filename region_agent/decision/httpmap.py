"""From a decision to the HTTP response a gateway should send (docs/invariants.md I5 for the Retry-After hint).

Pure functions. ``apply_http`` fills ``httpStatus``, ``headers`` and ``problem`` of a decision,
given the :class:`HttpAnswers` of the policy snapshot it was decided with (the agent's retry
jitter and the text of each rule's fields; region_agent.decision.plan.Snapshot holds one).

Retry jitter (I5: "Retry-After is a hint, not a reservation ... jitter added"). Clients denied in
the same instant must not come back in the same instant: 10,000 clients all told
``Retry-After: 1`` return together and recreate the spike. Every 429/503 decision with a hint
carries ``retryJitterMs``: an *upward* jitter drawn from ``[0, W)`` with
``W = min(max(minMs, pct% x retryAfterMs), maxMs)`` — at least about one second (``minMs``,
1,000 by default) for short hints, 10 % of long ones (a window reset, a pool exhausted until the
next window), at most 5 s — as a pure function of (seed, decisionId): different requests spread,
a retry of the same request gets the same hint. ``retryAfterMs`` stays the exact hint of the
store (500, 3,500 ...). ``Retry-After`` is ``max(1, ceil((retryAfterMs + retryJitterMs) / 1000))``:
never below the exact hint rounded up, and the whole seconds of the clients denied together
spread over the window (P-READ's 500 ms hint gives ``Retry-After: 1`` or ``2``, about half each;
a 58 s hint 58 to 63). Clients that read the body wait ``retryAfterMs + retryJitterMs``. With
``maxMs`` 0 (or ``minMs`` and ``pct`` both 0) there is no jitter: ``max(1, ceil(retryAfterMs/1000))``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

from kernel.bundle import Pool, Rule
from kernel.caches import BoundedMemo

from ..models import Decision, DeniedScope

OWN_SCOPES = frozenset({"user", "key"})
# a denial for one of these is 503 (retriable, not the caller's doing): the store or the agent
# cannot decide, the policy is in error, or a revocable rule's bundle is past its maximum age
UNAVAILABLE_REASONS = frozenset({"LIMITER_UNAVAILABLE", "POLICY_ERROR", "OVERLOADED", "POLICY_STALE"})


def retry_after_seconds(retry_after_ms: int) -> int | None:
    """``max(1, ceil(ms / 1000))``; ``None`` when the request can never succeed (-1)."""
    if retry_after_ms < 0:
        return None
    return max(1, math.ceil(retry_after_ms / 1000))


class RetryJitter:
    """The per-decision upward jitter of retry hints (module doc)."""

    __slots__ = ("_keyed", "max_ms", "min_ms", "pct", "seed")

    def __init__(self, pct: int = 10, max_ms: int = 5_000, seed: bytes = b"", min_ms: int = 1_000):
        self.pct = pct
        self.max_ms = max_ms
        self.min_ms = min_ms
        self.seed = hashlib.sha256(seed).digest()[:32]  # blake2b keys are at most 64 bytes
        # the keyed state once; a copy per decision is cheaper than keying a new hash each time
        self._keyed = hashlib.blake2b(digest_size=8, key=self.seed)

    def window(self, retry_after_ms: int) -> int:
        """W: the jitter is drawn from [0, W) (0: none)."""
        if retry_after_ms <= 0:
            return 0
        return min(max(self.min_ms, retry_after_ms * self.pct // 100), self.max_ms)

    def of(self, decision_id: str, retry_after_ms: int) -> int:
        bound = self.window(retry_after_ms)
        if bound <= 0:
            return 0
        h = self._keyed.copy()
        h.update(decision_id.encode())
        return int.from_bytes(h.digest(), "big") % bound


def retry_after(jitter: RetryJitter, decision_id: str, retry_after_ms: int) -> tuple[str, int] | None:
    """(the ``Retry-After`` value, ``retryJitterMs``) of a denial with hint ``retry_after_ms``;
    None when it can never succeed (-1)."""
    if retry_after_ms < 0:
        return None
    jitter_ms = jitter.of(decision_id, retry_after_ms)
    return str(max(1, -(-(retry_after_ms + jitter_ms) // 1000))), jitter_ms


def window_seconds(rule: Rule, pools: Mapping[str, Pool] | None = None) -> int:
    """The window a rule is advertised with: the full-refill time for buckets."""
    return max(1, math.ceil(rule.policy_window_ms(pools or {}) / 1000))


POLICY_FIELDS_MAX = 4_096  # (rule, limit) pairs of one snapshot whose field text is kept


class HttpAnswers:
    """What the HTTP answers of one policy snapshot need besides the decision: the agent's retry
    jitter (its settings) and the text of each rule's RateLimit fields, built once per rule and
    limit of the snapshot (a bounded memo; the snapshot owns it, so it goes with the snapshot)."""

    __slots__ = ("_fields", "jitter")

    def __init__(self, jitter: RetryJitter | None = None):
        self.jitter = jitter if jitter is not None else RetryJitter()
        # (rule id, limit) -> (RateLimit-Policy value, RateLimit prefix): rule ids are unique in a bundle
        self._fields: BoundedMemo[tuple[str, int], tuple[str, str]] = BoundedMemo(POLICY_FIELDS_MAX)

    def policy_fields(self, rule: Rule, limit: int) -> tuple[str, str]:
        """(RateLimit-Policy value, RateLimit prefix up to the remaining count) of ``rule`` at ``limit``."""
        k = (rule.id, limit)
        hit = self._fields.get(k)
        if hit is None:
            hit = self._fields.put(k, (f'"{rule.id}";q={limit};w={window_seconds(rule)}', f'"{rule.id}";r='))
        return hit


def ratelimit_headers(answers: HttpAnswers, rule: Rule, *, limit: int, remaining: int,
                      retry_after_ms: int) -> dict[str, str]:
    """Draft RateLimit / RateLimit-Policy fields for the caller's own scope."""
    policy, prefix = answers.policy_fields(rule, limit)
    t = 0 if retry_after_ms <= 0 else -(-retry_after_ms // 1000)
    return {"RateLimit-Policy": policy, "RateLimit": f"{prefix}{remaining if remaining > 0 else 0};t={t}"}


def admitted_fields(answers: HttpAnswers, rule: Rule, limit: int, *, anonymous: bool) -> tuple[str, str] | None:
    """The parts of an admission's headers that do not depend on its count, as :func:`apply_http`
    gives them to a store admission reported by ``rule`` (not a fallback; limit and remaining
    known): (RateLimit-Policy, RateLimit prefix) for the caller's own scope, None (no headers)
    for any other scope or an anonymous caller. Its RateLimit field is ``f"{prefix}{remaining};t=0"``."""
    if anonymous or rule.scope not in OWN_SCOPES:
        return None
    return answers.policy_fields(rule, limit)


def _problem(status: int, decision: Decision, anonymous: bool) -> dict[str, Any]:
    if anonymous:  # generic: no policy names, tenants, limits or counts
        title = "Too Many Requests" if status == 429 else "Service Unavailable"
        return {"type": "about:blank", "title": title, "status": status}
    if status == 429:
        return {"type": "about:blank", "title": "Rate limit exceeded", "status": 429,
                "detail": "Too many requests for this credential. Retry after the interval given.",
                "decisionId": decision.decision_id}
    if decision.reason == "OVERLOADED":
        return {"type": "about:blank", "title": "Service temporarily unavailable", "status": 503,
                "detail": "The rate limiter is overloaded and shed this decision. Retry after the interval given.",
                "decisionId": decision.decision_id}
    if decision.reason == "POLICY_STALE":
        return {"type": "about:blank", "title": "Service temporarily unavailable", "status": 503,
                "detail": "The rate limit policy in force is older than its maximum age. Retry later.",
                "decisionId": decision.decision_id}
    return {"type": "about:blank", "title": "Service temporarily unavailable", "status": 503,
            "detail": "The rate limiter cannot decide right now. Retry after the interval given.",
            "decisionId": decision.decision_id}


def apply_http(decision: Decision, *, rule: Rule | None, anonymous: bool, answers: HttpAnswers) -> bool:
    """Fill the HTTP fields. Returns True when a 429 had to omit Retry-After (a policy defect:
    retry -1 means the request can never succeed under this policy)."""
    if decision.allowed:  # 200, no problem (the record's defaults): only the caller's RateLimit fields
        if (rule is not None and not anonymous and rule.scope in OWN_SCOPES and not decision.fallback
                and decision.limit is not None and decision.remaining is not None):
            decision.headers = ratelimit_headers(answers, rule, limit=decision.limit, remaining=decision.remaining,
                                                 retry_after_ms=decision.retry_after_ms)
        else:
            decision.headers = {}
        decision.http_status = 200
        decision.problem = None
        return False
    headers: dict[str, str] = {}
    defect = False
    if decision.reason in UNAVAILABLE_REASONS and not decision.fallback:
        status = 503
    else:
        status = 429
    hint = retry_after(answers.jitter, decision.decision_id, decision.retry_after_ms)
    if hint is None:
        defect = status == 429
    else:
        headers["Retry-After"], decision.retry_jitter_ms = hint
    if (rule is not None and not anonymous and rule.scope in OWN_SCOPES and status != 503
            and not decision.fallback and decision.denied_scope != DeniedScope.CONCURRENCY
            and decision.limit is not None and decision.remaining is not None):
        headers.update(ratelimit_headers(answers, rule, limit=decision.limit, remaining=decision.remaining,
                                         retry_after_ms=decision.retry_after_ms))
    decision.http_status = status
    decision.headers = headers
    decision.problem = _problem(status, decision, anonymous)
    return defect
