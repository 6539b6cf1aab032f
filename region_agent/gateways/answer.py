"""Leasehold's decision in a gateway's own words. Pure: no I/O, no protobuf.

* :func:`rls_answer` — the fields of an Envoy ``RateLimitResponse`` for the decisions of one
  call's descriptors (protobuf assembly is in :mod:`.rls`).
* :func:`authz_answer` — status, headers and body of a forward-auth answer.

Both carry exactly the HTTP status semantics and headers ``/v1/admit`` computes
(:func:`region_agent.decision.httpmap.apply_http`): ``Retry-After`` on 429/503, and the ``RateLimit`` /
``RateLimit-Policy`` fields only for an authenticated caller's own (user/key) scope.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kernel.bundle import Rule

from ..decision.plan import Snapshot
from ..models import Decision

# Envoy's RateLimitResponse.RateLimit.Unit; MONTH and YEAR have no fixed length: never used
UNIT_MS = (("SECOND", 1_000), ("MINUTE", 60_000), ("HOUR", 3_600_000), ("DAY", 86_400_000),
           ("WEEK", 604_800_000))
PROBLEM_TYPE = "application/problem+json"
_encode = msgspec.json.Encoder().encode


def per_unit(rule: Rule, snap: Snapshot) -> tuple[int, str] | None:
    """:func:`rule_per_unit`, remembered per rule of the snapshot (``Snapshot.per_unit``: at most
    one entry per rule of its bundle)."""
    memo = snap.per_unit
    try:
        return memo[rule.id]
    except KeyError:
        out = memo[rule.id] = rule_per_unit(rule, snap)
        return out


def rule_per_unit(rule: Rule, snap: Snapshot) -> tuple[int, str] | None:
    """(requests_per_unit, unit) when the rule's limit is exactly that, else None.

    A rate that scales (a bucket's refill): the sustained rate in the smallest unit where it is a
    whole number (P-READ 2/SECOND, P-TENANT 1,000/MINUTE). A count per window (windows, pools):
    the limit, only when the window is exactly one unit (a 20-per-10-s window is not 2 per second)."""
    rate = rule.rate(snap.pools)
    if not rate.millis or not rate.per_ms:
        return None
    for unit, ms in UNIT_MS:
        if rate.scalable:
            num, den = rate.millis * ms, rate.per_ms * 1000
            if num % den == 0 and num // den >= 1:
                return num // den, unit
        elif rate.per_ms == ms and rate.millis % 1000 == 0:
            return rate.millis // 1000, unit
    return None


@dataclass(slots=True)
class DescriptorAnswer:
    over_limit: bool
    limit_name: str | None = None  # current_limit.name (the rule id); None: no current_limit
    requests_per_unit: int = 0
    unit: str = "UNKNOWN"
    remaining: int = 0
    reset_ms: int = 0  # duration_until_reset; 0: unset


@dataclass(slots=True)
class RlsAnswer:
    over_limit: bool
    http_status: int  # the status /v1/admit would have the gateway send: 200 | 429 | 503
    statuses: list[DescriptorAnswer]
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    metadata: dict[str, object] = field(default_factory=dict)  # dynamic metadata (Envoy: envoy.filters.http.ratelimit)


def deciding(decisions: list[Decision]) -> Decision:
    """The decision whose HTTP answer the caller gets: a 503 (a closed rule without its store)
    before any 429, then the longest Retry-After; with nothing denied, the first one that
    carries RateLimit fields (the caller's own scope), else the first."""
    denied = [d for d in decisions if d.http_status != 200]
    if denied:
        return max(denied, key=lambda d: (d.http_status == 503, d.retry_after_ms if d.retry_after_ms >= 0 else 1 << 62))
    return next((d for d in decisions if "RateLimit" in d.headers), decisions[0])


def descriptor_answer(d: Decision, snap: Snapshot, *, anonymous: bool) -> DescriptorAnswer:
    """current_limit / limit_remaining / duration_until_reset of one descriptor. Anonymous
    (pre-auth) questions get none of them: no policy names, limits or counts."""
    over = d.http_status != 200
    out = DescriptorAnswer(over_limit=over)
    if anonymous:
        return out
    if over and d.retry_after_ms > 0:
        out.reset_ms = d.retry_after_ms
    rule = snap.rules_by_id.get(d.rule_id) if d.rule_id else None
    if rule is None or d.fallback or d.limit is None:
        return out  # no rule, or a local fallback allowance (not the rule's shared limit)
    out.limit_name = rule.id
    pu = per_unit(rule, snap)
    if pu is not None:
        out.requests_per_unit, out.unit = pu
    out.remaining = max(0, d.remaining or 0)
    return out


def rls_answer(decisions: list[Decision], snap: Snapshot, anonymous: list[bool]) -> RlsAnswer:
    statuses = [descriptor_answer(d, snap, anonymous=a) for d, a in zip(decisions, anonymous, strict=True)]
    top = deciding(decisions)
    over = top.http_status != 200
    headers = dict(top.headers)
    body = b""
    meta: dict[str, object] = {}
    if over:
        headers["content-type"] = PROBLEM_TYPE
        body = _encode(top.problem or {"status": top.http_status})
        meta = {"status": top.http_status, "reason": top.reason or ""}
    return RlsAnswer(over_limit=over, http_status=top.http_status, statuses=statuses, headers=headers,
                     body=body, metadata=meta)


@dataclass(slots=True)
class AuthzAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def authz_answer(d: Decision, *, deny_status: int | None = None) -> AuthzAnswer:
    """The forward-auth answer: 200 (with the RateLimit fields of the caller's own scope), 429
    (Retry-After) or 503 (a closed rule without its store), with the problem body. With
    ``deny_status`` (401/403, for nginx auth_request) a denial is sent with that status and its
    real one in ``X-Leasehold-Status``; the nginx config turns it back into 429/503."""
    headers = dict(d.headers)
    if d.http_status == 200:
        return AuthzAnswer(200, headers, b"")
    headers["content-type"] = PROBLEM_TYPE
    body = _encode(d.problem or {"status": d.http_status})
    status = d.http_status
    if deny_status is not None:
        headers["x-leasehold-status"] = str(status)
        status = deny_status
    return AuthzAnswer(status, headers, body)


__all__ = ["AuthzAnswer", "DescriptorAnswer", "RlsAnswer", "authz_answer", "deciding", "descriptor_answer",
           "per_unit", "rls_answer", "rule_per_unit"]
