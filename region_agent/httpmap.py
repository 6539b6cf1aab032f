"""From a decision to the HTTP response a gateway should send (seed ch. 1 table, ch. 11).

Pure functions. ``apply_http`` fills ``httpStatus``, ``headers`` and ``problem`` of a decision.
"""

from __future__ import annotations

import math
from typing import Any

from kernel.bundle import Rule

from .models import Decision

OWN_SCOPES = frozenset({"user", "key"})


def retry_after_seconds(retry_after_ms: int) -> int | None:
    """``max(1, ceil(ms / 1000))``; ``None`` when the request can never succeed (-1)."""
    if retry_after_ms < 0:
        return None
    return max(1, math.ceil(retry_after_ms / 1000))


def window_seconds(rule: Rule) -> int:
    """The window a rule is advertised with: the full-refill time for buckets."""
    if rule.algorithm in ("token_bucket", "gcra") and rule.refill_millis:
        ms = (rule.capacity_millis or 0) * (rule.period_ms or 0) / rule.refill_millis
    else:
        ms = rule.window_ms or 0
    return max(1, math.ceil(ms / 1000))


def ratelimit_headers(rule: Rule, *, limit: int, remaining: int, retry_after_ms: int) -> dict[str, str]:
    """Draft RateLimit / RateLimit-Policy fields for the caller's own scope."""
    t = 0 if retry_after_ms <= 0 else math.ceil(retry_after_ms / 1000)
    return {
        "RateLimit-Policy": f'"{rule.id}";q={limit};w={window_seconds(rule)}',
        "RateLimit": f'"{rule.id}";r={max(0, remaining)};t={t}',
    }


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
    return {"type": "about:blank", "title": "Service temporarily unavailable", "status": 503,
            "detail": "The rate limiter cannot decide right now. Retry after the interval given.",
            "decisionId": decision.decision_id}


def apply_http(decision: Decision, *, rule: Rule | None, anonymous: bool) -> bool:
    """Fill the HTTP fields. Returns True when a 429 had to omit Retry-After (a policy defect:
    retry -1 means the request can never succeed under this policy)."""
    headers: dict[str, str] = {}
    defect = False
    if decision.allowed:
        status = 200
    elif decision.reason in ("LIMITER_UNAVAILABLE", "POLICY_ERROR", "OVERLOADED") and not decision.fallback:
        status = 503
    else:
        status = 429
    if status != 200:
        secs = retry_after_seconds(decision.retry_after_ms)
        if secs is None:
            defect = status == 429
        else:
            headers["Retry-After"] = str(secs)
    if (rule is not None and not anonymous and rule.scope in OWN_SCOPES and status != 503
            and not decision.fallback and decision.denied_scope != "concurrency"
            and decision.limit is not None and decision.remaining is not None):
        headers.update(ratelimit_headers(rule, limit=decision.limit, remaining=decision.remaining,
                                         retry_after_ms=decision.retry_after_ms))
    decision.http_status = status
    decision.headers = headers
    decision.problem = None if status == 200 else _problem(status, decision, anonymous)
    return defect
