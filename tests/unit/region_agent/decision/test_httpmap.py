from __future__ import annotations

import pytest

from kernel.bundle import make_rule
from region_agent.decision.httpmap import HttpAnswers, RetryJitter, apply_http, retry_after_seconds
from region_agent.models import Decision, DeniedScope

# These tests check the worked numbers' exact Retry-After (max(1, ceil(ms / 1000))): jitter off here
# (its spread has its own tests: test_retry_jitter.py)
HTTP = HttpAnswers(RetryJitter(0, 0, min_ms=0))

USER = make_rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
            refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded")
TENANT = make_rule(id="tenant-atlas-minute", scope="tenant", tenant="atlas", algorithm="token_bucket",
              capacity_millis=1_000_000, refill_millis=1_000_000, period_ms=60_000, cost_millis=1_000,
              fail_mode="local_bounded")
WINDOW_KEY = make_rule(id="key-window", scope="key", algorithm="fixed_window", limit=100, window_ms=60_000,
                  fail_mode="open")


def dec(**kw) -> Decision:
    base = dict(allowed=False, decision_id="r-1", rule_id="x", bundle_version=42, denied_scope=DeniedScope.USER,
                reason="RATE_EXCEEDED", limit=20, remaining=0, retry_after_ms=500)
    base.update(kw)
    return Decision(**base)


@pytest.mark.parametrize("ms, secs", [(500, 1), (1, 1), (0, 1), (1000, 1), (1001, 2), (3500, 4), (420, 1),
                                      (-1, None)])
def test_retry_after_rounding(ms, secs):
    assert retry_after_seconds(ms) == secs


def test_denied_user_scope_gets_retry_after_and_own_ratelimit_fields():
    d = dec()
    assert apply_http(d, rule=USER, anonymous=False, answers=HTTP) is False
    assert d.http_status == 429
    assert d.headers == {"Retry-After": "1", "RateLimit-Policy": '"read-user-v3";q=20;w=10',
                         "RateLimit": '"read-user-v3";r=0;t=1'}
    assert d.problem["status"] == 429 and d.problem["decisionId"] == "r-1"


def test_window_rule_of_the_callers_key():
    d = dec(allowed=True, denied_scope=None, reason=None, limit=100, remaining=42, retry_after_ms=0)
    apply_http(d, rule=WINDOW_KEY, anonymous=False, answers=HTTP)
    assert d.http_status == 200 and d.problem is None
    assert d.headers == {"RateLimit-Policy": '"key-window";q=100;w=60', "RateLimit": '"key-window";r=42;t=0'}


def test_tenant_scope_never_exposes_numbers():
    d = dec(denied_scope=DeniedScope.TENANT, limit=1000, remaining=3, retry_after_ms=420)
    apply_http(d, rule=TENANT, anonymous=False, answers=HTTP)
    assert d.headers == {"Retry-After": "1"}


def test_anonymous_gets_a_generic_answer():
    d = dec(denied_scope=DeniedScope.IP, retry_after_ms=3500)
    apply_http(d, rule=USER, anonymous=True, answers=HTTP)
    assert d.headers == {"Retry-After": "4"}
    assert d.problem == {"type": "about:blank", "title": "Too Many Requests", "status": 429}


def test_never_satisfiable_omits_retry_after_and_reports_a_defect():
    d = dec(retry_after_ms=-1)
    assert apply_http(d, rule=TENANT, anonymous=False, answers=HTTP) is True
    assert d.http_status == 429 and "Retry-After" not in d.headers


def test_limiter_unavailable_closed_is_503_and_fallback_exhausted_is_429():
    d = dec(reason="LIMITER_UNAVAILABLE", denied_scope=DeniedScope.TENANT, retry_after_ms=5_000)
    apply_http(d, rule=TENANT, anonymous=False, answers=HTTP)
    assert d.http_status == 503 and d.headers == {"Retry-After": "5"} and d.problem["status"] == 503
    d = dec(fallback=True, retry_after_ms=4_000)
    apply_http(d, rule=USER, anonymous=False, answers=HTTP)
    assert d.http_status == 429 and d.headers == {"Retry-After": "4"}


def test_concurrency_denial_uses_the_policy_retry_after_without_ratelimit_fields():
    d = dec(denied_scope=DeniedScope.CONCURRENCY, reason="CONCURRENCY_EXCEEDED", retry_after_ms=5_000, limit=3)
    apply_http(d, rule=USER, anonymous=False, answers=HTTP)
    assert d.http_status == 429 and d.headers == {"Retry-After": "5"}
