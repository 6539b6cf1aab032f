"""The checker judges what Envoys admitted from RLQS quota assignments against the bound with its
RLQS term (kernel.bound.rlqs_term, per Envoy x bucket x window): a history whose Envoy-side
admissions break the term fails, one within it passes; an Envoy cut off from its agent adds its
fallback only in the windows the fault touched. And the inputs of the term come from the Envoy
configuration as rendered (the shipped one: deny-all, so 0) and from Envoy's own access log."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from chaos.checker import check
from chaos.history import DecisionRec, Fault, PoolSpend, RlqsRec, TopologyRec
from chaos.invariants import PoolPolicy
from chaos.rlqs import EnvoyTenant, RlqsEnvoy, config_fallback, decisions_from_log
from kernel.bound import RlqsShape, rlqs_term
from leasehold.local.gateways import render

W = 10_000
K = 3
TOPO = TopologyRec(agents={"eu": ["agent-eu-1", "agent-eu-2"]})
ENVOYS = {"eu": ["envoy-eu-a", "envoy-eu-b"]}


def pool(window_ms: int = W, limit: int = 100) -> PoolPolicy:
    return PoolPolicy(id="p", limit=limit, window_ms=window_ms, fallback_per_region=10)


def envoy_admissions(n: int, envoy: str = "envoy-eu-a", *, window_ms: int = W, index: int = K,
                     allowed: bool = True) -> list[DecisionRec]:
    """``n`` requests an Envoy decided itself in window ``index`` (as read from its access log)."""
    start = index * window_ms + 100
    return [DecisionRec(agent="agent-eu-1", region="eu", tenant="atlas", allowed=allowed, sent_at_ms=start + i,
                        recorded_at_ms=start + i + 2, spends=[PoolSpend(pool="p", window_index=index, rule="r")],
                        reason="via_upstream" if allowed else "rate_limited_by_quota", gateway=envoy)
            for i in range(n)]


def rlqs(fallback: int | None = 0, buckets: int = 2, max_assignment: int = 5) -> RlqsRec:
    return RlqsRec(envoys=ENVOYS, buckets={"p": buckets}, max_assignment=max_assignment, fallback=fallback)


def verdict(records: list, policy: PoolPolicy):
    return check(records, [policy]).verdict("admitted_within_bound")


def test_envoy_admissions_beyond_g_plus_a_zero_rlqs_term_fail():
    """Windows long enough to end every assignment in them, deny-all fallbacks: the term is 0, so
    one Envoy admission past G is a violation, and the report says the RLQS term was counted."""
    p = pool()
    assert verdict([TOPO, rlqs(), *envoy_admissions(60), *envoy_admissions(40, "envoy-eu-b")], p).ok
    v = verdict([TOPO, rlqs(), *envoy_admissions(61), *envoy_admissions(40, "envoy-eu-b")], p)
    assert not v.ok
    assert "admitted 101 > bound 100" in v.violations[0].detail and "RLQS 0" in v.violations[0].detail


def test_a_window_too_short_to_clamp_allows_one_assignment_per_envoy_and_bucket():
    """A 1 s window: an assignment (whole seconds) may run into the next one. The term is
    2 Envoys x 2 buckets x 5 tokens = 20: 120 passes, 121 fails."""
    p = pool(window_ms=1_000)
    term = rlqs_term(RlqsShape(envoys={"eu": 2}, buckets=2, max_assignment=5), 1_000)
    assert term.tokens == 20
    ok = envoy_admissions(70, window_ms=1_000) + envoy_admissions(50, "envoy-eu-b", window_ms=1_000)
    assert verdict([TOPO, rlqs(), *ok], p).ok
    report = check([TOPO, rlqs(), *ok], [p])
    assert report.worst["p"].rlqs_allowance == 20 and report.worst["p"].bound == 120
    bad = ok + envoy_admissions(1, window_ms=1_000)
    assert not verdict([TOPO, rlqs(), *bad], p).ok


def test_an_envoy_cut_off_adds_its_fallback_only_in_the_windows_it_touched():
    """Fallback 3 tokens per Envoy x bucket (a configuration other than the shipped deny-all): one
    Envoy cut off during window K allows 100 + 1 x 2 x 3 = 106 there, and nothing in window K + 2."""
    p = pool()
    fault = Fault(nemesis="partition", target="agent-eu-1<-envoy-eu-a", start_ms=K * W + 500, stop_ms=K * W + 900,
                  envoys_cut_off=["envoy-eu-a"])
    assert verdict([TOPO, rlqs(fallback=3), fault, *envoy_admissions(106)], p).ok
    assert not verdict([TOPO, rlqs(fallback=3), fault, *envoy_admissions(107)], p).ok
    assert not verdict([TOPO, rlqs(fallback=3), fault, *envoy_admissions(101, index=K + 2)], p).ok
    # no fault: the fallback counts for nothing
    assert not verdict([TOPO, rlqs(fallback=3), *envoy_admissions(101)], p).ok


def test_an_unbounded_envoy_fallback_is_reported_not_invented():
    """An Envoy that admits everything once cut off (ALLOW_ALL): a window it was cut off in has
    no finite bound, and the check says so."""
    p = pool()
    fault = Fault(nemesis="pause", target="agent-eu-1", start_ms=K * W + 500, stop_ms=K * W + 900,
                  envoys_cut_off=["envoy-eu-a"])
    v = verdict([TOPO, rlqs(fallback=None), fault, *envoy_admissions(10)], p)
    assert not v.ok and "no finite bound" in v.violations[0].detail and "Envoy" in v.violations[0].detail


def shipped(**overrides: str) -> str:
    values = dict(ENVOY_LISTEN_HOST="127.0.0.1", ENVOY_PORT=1, ENVOY_ADMIN_PORT=2, ENVOY_ACCESS_LOG="/dev/null",
                  AGENT_HOST="127.0.0.1", AGENT_RLS_PORT=3, UPSTREAM_HOST="127.0.0.1", UPSTREAM_PORT=4,
                  GATEWAY_TOKEN="t", JWKS_FILE="/dev/null", JWT_ISSUER="i", JWT_AUDIENCE="a")
    return render("envoy-rlqs.yaml", **{**values, **overrides})


def test_the_shipped_configuration_denies_without_an_assignment_so_its_fallback_is_zero():
    cfg = shipped()
    assert config_fallback(cfg) == 0
    # the same file with a bucket that admits everything once its assignment expires: unbounded
    assert config_fallback(cfg.replace("blanket_rule: DENY_ALL}\n                            expired",
                                       "blanket_rule: ALLOW_ALL}\n                            expired", 1)) is None
    assert config_fallback(cfg.replace("{blanket_rule: DENY_ALL}", "{blanket_rule: ALLOW_ALL}")) is None


def test_envoy_decisions_are_read_from_its_own_access_log(tmp_path: Path):
    from chaos.bundles import chaos_bundle
    from kernel.bundle import Bundle

    bundle: Bundle = chaos_bundle()
    log = tmp_path / "envoy-eu-a" / "access.log"
    log.parent.mkdir()
    lines = [
        {"start_ms": "1800000000100", "duration_ms": "3", "status": "200", "details": "via_upstream",
         "route_group": "read", "bucket": {"tenant": "atlas", "user": "E-1", "api_key": "K1", "route_group": "read"}},
        {"start_ms": "1800000000200", "duration_ms": "0", "status": "429", "details": "rate_limited_by_quota",
         "route_group": "read", "bucket": {"tenant": "birch", "user": "E-2", "route_group": "read"}},
        {"start_ms": "1800000000300", "duration_ms": "1", "status": "401", "details": "jwt_authn_access_denied",
         "route_group": None, "bucket": None},  # no identity: no quota bucket, not a quota decision
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"start_ms\": \"18")  # a line cut short
    # only the Envoy's working directory is read (its access log), no process
    e = RlqsEnvoy("envoy-eu-a", "eu", "agent-eu-1", envoy=cast(Any, SimpleNamespace(workdir=log.parent)),
                  proxy=cast(Any, None))
    recs = decisions_from_log(e, bundle, (EnvoyTenant("atlas", 1.0, api_key="K1"), EnvoyTenant("birch", 1.0)))
    assert [(r.tenant, r.allowed, r.gateway) for r in recs] == [("atlas", True, "envoy-eu-a"),
                                                                 ("birch", False, "envoy-eu-a")]
    assert (recs[0].sent_at_ms, recs[0].recorded_at_ms) == (1800000000100, 1800000000103)
    assert [s.pool for s in recs[0].spends] == ["atlas-w"] and [s.pool for s in recs[1].spends] == ["birch-w"]
    assert recs[1].reason == "rate_limited_by_quota"


@pytest.mark.parametrize("fallback", [0, None])
def test_the_rlqs_record_round_trips_through_a_history_file(tmp_path: Path, fallback: int | None):
    from chaos.history import HistoryWriter, read_history

    with HistoryWriter(tmp_path / "h.jsonl") as w:
        w.write(rlqs(fallback=fallback))
    (rec,) = list(read_history(tmp_path / "h.jsonl"))
    assert rec == rlqs(fallback=fallback)
