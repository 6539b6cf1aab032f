"""The checker catches each broken invariant in a hand-made history, and passes a clean one."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from chaos.checker import INVARIANTS, check
from chaos.history import (
    DecisionRec,
    EtcdGrant,
    EtcdWindow,
    Fault,
    Grant,
    HistoryWriter,
    Leader,
    Policy,
    PoolSpend,
    SpendClose,
    TopologyRec,
    read_history,
)
from chaos.invariants import PoolPolicy, policy_for_window
from kernel.bundle import Pool

W = 10_000  # windowMs
K = 3  # the window every record below lives in: [30_000, 40_000)
POOL = Pool(id="p-global", window_ms=W, limit=100, chunk_max=50, fallback_per_region=10)


def grant(lease: str, region: str, granted: int, *, epoch: int = 5, sent: int = 30_000, ttl: int = 5_000,
          index: int = K, **kw) -> Grant:
    return Grant(lease_id=lease, pool="p-global", region=region, granted=granted, window_index=index,
                 window_start_ms=index * W, window_end_ms=(index + 1) * W, expires_at_ms=sent + ttl, ttl_ms=ttl,
                 epoch=epoch, sent_at_ms=sent, received_at_ms=sent + 10, **kw)


def etcd(g: Grant, rev: int, **changes) -> EtcdGrant:
    rec = EtcdGrant(lease_id=g.lease_id, pool=g.pool, region=g.region, granted=g.granted,
                    window_index=g.window_index, epoch=g.epoch, expires_at_ms=g.expires_at_ms, mod_revision=rev)
    return msgspec.structs.replace(rec, **changes)


def spend(region: str, at: int, lease: str | None, tokens: int = 1, *, fallback: bool = False,
          local: bool = False, allowed: bool = True, index: int = K, agent: int = 1, sent: int | None = None
          ) -> DecisionRec:
    return DecisionRec(agent=f"agent-{region}-{agent}", region=region, tenant="atlas", allowed=allowed,
                    recorded_at_ms=at, sent_at_ms=sent,
                    spends=[PoolSpend(pool="p-global", tokens=tokens, lease_id=lease, window_index=index)],
                    fallback=fallback, local=local, reason=None if allowed else "pool_exhausted")


TOPO = TopologyRec(agents={"eu": ["agent-eu-1", "agent-eu-2"], "us": ["agent-us-1", "agent-us-2"]})


def cut(region: str, start: int, stop: int | None, grace: int = 0) -> Fault:
    """``region`` cannot reach the allocator from ``start`` to ``stop`` (+ grace)."""
    return Fault(nemesis="partition", target=f"{region}->allocator", start_ms=start, stop_ms=stop,
                 allocator_regions=[region], grace_ms=grace)


def redis_down(region: str, start: int, stop: int | None, agents: tuple[int, ...] = (1, 2), grace: int = 0) -> Fault:
    return Fault(nemesis="redis-restart", target=f"redis-{region}", start_ms=start, stop_ms=stop,
                 redis_agents=[f"agent-{region}-{a}" for a in agents], grace_ms=grace)


def clean() -> list:
    g1, g2 = grant("lease-eu-0001", "eu", 50), grant("lease-us-0001", "us", 50, sent=30_100)
    return [
        TOPO,
        Leader(epoch=5, node="alloc-1", observed_at_ms=29_000),
        g1, g2,
        spend("eu", 30_200, "lease-eu-0001", 40),
        spend("us", 30_300, "lease-us-0001", 45),
        spend("us", 30_400, None, 15, allowed=False),  # demand above G: denied
        spend("eu", 34_000, None, 5, fallback=True),  # allocator unreachable: fallback
        SpendClose(lease_id="lease-eu-0001", pool="p-global", region="eu", granted=50, spent=40),
        cut("eu", 33_000, 35_000),
        etcd(g1, 10, spent=40, returned=10), etcd(g2, 11),
        EtcdWindow(pool="p-global", window_index=K, limit=100, remaining=10, granted=100, returned=10),
    ]


def failing(recs, name: str, tolerance_ms: int = 250):
    report = check(recs, [POOL], tolerance_ms)
    bad = {v.invariant for v in report.verdicts if not v.ok}
    assert name in bad, report.render()
    assert not report.ok
    return report


def test_clean_history_passes_every_invariant():
    report = check(clean(), [POOL])
    assert report.ok, report.render()
    assert [v.invariant for v in report.verdicts] == list(INVARIANTS)
    assert all(v.checked for v in report.verdicts if v.invariant != "fault_free_utilisation")
    # the only window is cut short by the load and a fault touched it: reported, not judged
    assert not report.verdict("fault_free_utilisation").checked
    assert [u.touched for u in report.utilisation] == ["edge of the load"]
    w = report.worst["p-global"]
    assert (w.window_index, w.admitted, w.limit, w.bound) == (K, 90, 100, 110)
    assert [(u.pool, u.window_index, u.admitted, u.demand) for u in report.utilisation] == [("p-global", K, 90, 105)]
    assert "PASS" in report.render() and "partition" in report.render()


def test_over_grant_in_etcd_is_reported():
    recs = clean() + [etcd(grant("lease-eu-0002", "eu", 20), 12)]
    report = failing(recs, "granted_within_limit")
    v = report.verdict("granted_within_limit").violations[0]
    assert (v.pool, v.window_index, v.observed, v.bound) == ("p-global", K, 110, 100)


def test_double_grant_with_different_content_is_reported():
    recs = clean() + [grant("lease-eu-0001", "eu", 30, sent=30_500)]
    report = failing(recs, "no_double_grant")
    assert report.verdict("no_double_grant").violations[0].lease_id == "lease-eu-0001"


def test_identical_replay_is_not_a_double_grant():
    recs = clean() + [grant("lease-eu-0001", "eu", 50, sent=30_000, replayed=True)]
    assert check(recs, [POOL]).ok


def test_stale_epoch_commit_is_reported():
    # epoch 11 was elected at revision 11; a grant stamped epoch 5 committed later (revision 12)
    stale = grant("lease-us-0002", "us", 0, epoch=5)
    recs = clean() + [Leader(epoch=11, node="alloc-2", observed_at_ms=31_000), etcd(stale, 12)]
    report = failing(recs, "no_stale_epoch_commit")
    v = report.verdict("no_stale_epoch_commit").violations[0]
    assert (v.lease_id, v.observed, v.bound) == ("lease-us-0002", 12, 11)


def test_stale_epoch_commit_detected_from_grant_epochs_alone():
    newer = grant("lease-eu-0002", "eu", 0, epoch=11)
    stale = grant("lease-us-0002", "us", 0, epoch=5)
    failing(clean() + [etcd(newer, 11), etcd(stale, 14)], "no_stale_epoch_commit")


def test_region_accepting_an_older_epoch_is_reported():
    newer = grant("lease-eu-0002", "eu", 0, epoch=11, sent=31_000)
    older = grant("lease-eu-0003", "eu", 0, epoch=5, sent=32_000)
    failing(clean() + [newer, older], "no_stale_epoch_accept")
    refused = msgspec.structs.replace(older, accepted=False)
    assert check(clean() + [newer, refused], [POOL]).verdict("no_stale_epoch_accept").ok


def test_spend_beyond_grant_is_reported():
    recs = clean() + [spend("us", 30_600, "lease-us-0001", 6)]
    report = failing(recs, "lease_spend_within_grant")
    v = report.verdict("lease_spend_within_grant").violations[0]
    assert (v.lease_id, v.observed, v.bound) == ("lease-us-0001", 51, 50)


def test_spending_tokens_the_usage_report_gave_back_is_reported():
    # lease-eu-0001 reported 40 spent and returned 10 to the pool: it may not spend them afterwards
    recs = clean() + [spend("eu", 30_600, "lease-eu-0001", 1)]
    report = failing(recs, "lease_spend_within_grant")
    v = report.verdict("lease_spend_within_grant").violations[0]
    assert (v.observed, v.bound) == (41, 40) and "returned 10" in v.detail


def test_returned_tokens_granted_again_are_not_an_over_grant():
    again = grant("lease-us-0002", "us", 10, sent=36_000)
    recs = clean() + [again, etcd(again, 12)]
    assert check(recs, [POOL]).ok
    recs = clean() + [grant("lease-us-0003", "us", 11, sent=36_000), etcd(grant("lease-us-0003", "us", 11), 12)]
    failing(recs, "granted_within_limit")


def test_etcd_window_state_over_limit_or_inconsistent_is_reported():
    over = EtcdWindow(pool="p-global", window_index=K + 1, limit=100, remaining=0, granted=120, returned=10)
    report = failing(clean() + [over], "window_states_within_limit")
    assert {v.observed for v in report.verdict("window_states_within_limit").violations} == {110, 0}
    skewed = EtcdWindow(pool="p-global", window_index=K + 1, limit=100, remaining=50, granted=40)
    failing(clean() + [skewed], "window_states_within_limit")


def test_spend_on_unknown_lease_and_closing_report_beyond_grant_are_reported():
    failing(clean() + [spend("eu", 30_600, "lease-nowhere-1", 1)], "lease_spend_within_grant")
    close = SpendClose(lease_id="lease-us-0001", pool="p-global", region="us", granted=50, spent=70)
    report = failing(clean() + [close], "lease_spend_within_grant")
    assert "closing report" in report.verdict("lease_spend_within_grant").violations[0].detail


def test_spend_after_expiry_is_reported_beyond_the_tolerance_only():
    # lease-us-0001: sent 30_100 + ttl 5_000 -> deadline 35_100
    assert check(clean() + [spend("us", 35_300, "lease-us-0001", 1)], [POOL], tolerance_ms=250).ok
    report = failing(clean() + [spend("us", 35_400, "lease-us-0001", 1)], "no_spend_after_expiry", 250)
    v = report.verdict("no_spend_after_expiry").violations[0]
    assert v.lease_id == "lease-us-0001" and v.observed == 35_400


def test_spend_after_window_end_is_reported():
    long = grant("lease-us-0009", "us", 10, sent=38_000, ttl=15_000)  # unclamped ttl: the window check bites
    failing(clean() + [long, spend("us", 40_500, "lease-us-0009", 1)], "no_spend_after_expiry")


def test_overshoot_beyond_bound_is_reported():
    # us cut off too: G 100 + eu 10 + us 10 = 120; us admits 16 from fallback -> its allowance 10 exceeded
    recs = clean() + [cut("us", 34_000, 36_000), spend("us", 34_500, None, 16, fallback=True)]
    report = failing(recs, "admitted_within_bound")
    w = report.worst["p-global"]
    assert (w.admitted, w.bound, w.overshoot) == (106, 120, 6)
    assert any("region us admitted 16 not paid by a lease > its allowance 10" in v.detail
               for v in report.verdict("admitted_within_bound").violations)
    recs = clean() + [spend("us", 30_700, None, 25, local=True)]  # local admissions, no Redis fault stated
    report = failing(recs, "admitted_within_bound")
    assert report.worst["p-global"].excess == 5
    assert any("region us admitted 25 not paid by a lease > its allowance 0" in v.detail
               for v in report.verdict("admitted_within_bound").violations)


def test_fallback_without_a_fault_that_allows_it_is_reported_even_within_g():
    # demand below G: the total fits, but us had no reason to spend a fallback allowance (slow is not down)
    recs = [r for r in clean() if not (isinstance(r, DecisionRec) and r.region == "us")]
    recs.append(spend("us", 30_700, None, 3, fallback=True))
    report = failing(recs, "admitted_within_bound")
    assert report.worst["p-global"].excess < 0
    assert "region us admitted 3 not paid by a lease > its allowance 0" in report.render()


def test_regional_fallback_is_shared_by_the_agents_of_a_region():
    # both eu agents admit F each from fallback in one window: the region's allowance is F, not 2F
    base = [r for r in clean() if not (isinstance(r, DecisionRec) and r.fallback)]
    ok = base + [spend("eu", 34_000, None, 5, fallback=True, agent=1), spend("eu", 34_100, None, 5, fallback=True, agent=2)]
    assert check(ok, [POOL]).ok
    over = base + [spend("eu", 34_000, None, 10, fallback=True, agent=1),
                   spend("eu", 34_100, None, 10, fallback=True, agent=2)]
    report = failing(over, "admitted_within_bound")
    assert "region eu admitted 20 not paid by a lease > its allowance 10" in report.render()


def test_redis_loss_adds_f_per_agent_process_and_a_restart_counts_again():
    base = [r for r in clean() if not (isinstance(r, DecisionRec) and r.fallback)]
    # both us agents cut off from Redis (no grace): 2 x 10 in-process + no regional fallback for us
    fault = redis_down("us", 31_000, 33_000)
    ok = base + [fault, spend("us", 32_000, None, 10, local=True, agent=1),
                 spend("us", 32_100, None, 10, local=True, agent=2)]
    report = check(ok, [POOL])
    assert report.ok, report.render()
    assert report.worst["p-global"].local_allowance == 20
    over = ok + [spend("us", 32_200, None, 1, local=True, agent=2)]
    failing(over, "admitted_within_bound")
    restart = Fault(nemesis="kill", target="agent-us-2", start_ms=32_150, stop_ms=32_180,
                    restarted_agents=["agent-us-2"])
    assert check(over + [restart], [POOL]).ok  # the new process has a fresh allowance
    # the effect lasts until stop + grace: here up to the last millisecond of window K, or into K+1
    nxt = [spend("us", 40_100, None, 1, local=True, index=K + 1)]
    failing(base + [redis_down("us", 36_000, 37_000, grace=2_999)] + nxt, "admitted_within_bound")
    assert check(base + [redis_down("us", 36_000, 37_000, grace=3_000)] + nxt, [POOL]).ok


def test_local_admissions_policy_change_and_unattributable_lease_free_spends():
    extra = [spend("us", 30_700, None, 10, local=True), redis_down("us", 30_500, 31_000, agents=(1,))]
    assert check(clean() + extra, [POOL]).ok
    more = [spend("us", 30_700, None, 25)]  # paid by a lease we cannot name: counts against G
    failing(clean() + more, "admitted_within_bound")
    bigger = Policy(version=2, applied_at_ms=36_000,
                    pools=[PoolPolicy(id="p-global", limit=200, window_ms=W, fallback_per_region=10)])
    assert check(clean() + more + [bigger], [POOL]).ok
    later = msgspec.structs.replace(bigger, applied_at_ms=40_000)  # takes effect only in the next window
    failing(clean() + more + [later], "admitted_within_bound")


def _at_boundary(n: int, *, region: str = "us") -> list[DecisionRec]:
    """n requests sent just before the K/K+1 boundary and answered just after it."""
    return [spend(region, (K + 1) * W + 5, None, 1, sent=(K + 1) * W - 5) for _ in range(n)]


def test_straddling_admissions_are_attributed_to_a_window_where_they_fit():
    # window K holds 90 of G 100 (+10 eu fallback): 25 admissions between K and K+1 fit (20 in K, 5 in K+1)
    report = check(clean() + _at_boundary(25), [POOL])
    assert report.ok, report.render()
    assert "25 admission(s) between two windows" in report.verdict("admitted_within_bound").note
    admitted = {w.window_index: w.admitted for w in report.windows}
    assert admitted[K] + admitted[K + 1] == 90 + 25 and admitted[K] <= 110
    # window K+1 already full of lease-paid admissions: 21 straddlers no longer fit anywhere
    full = [spend("us", (K + 1) * W + 500, None, 100)]
    assert check(clean() + full + _at_boundary(20), [POOL]).ok
    report = failing(clean() + full + _at_boundary(21), "admitted_within_bound")
    assert "no attribution fits every window" in report.render()


def test_windows_are_the_allocators_clock_not_the_recorders():
    # the allocators run 2 s behind the recorder: recorder 40_500 is allocator 38_500, window K
    behind = TopologyRec(agents=TOPO.agents, allocator_offsets_ms={"allocator-1": -2_000, "allocator-2": -2_000})
    late = [spend("us", 41_500, None, 25, sent=41_400, index=K + 1)]  # recorder window K+1, allocator window K
    recs = [r for r in clean() if not isinstance(r, TopologyRec)]
    assert check(recs + [TOPO] + late, [POOL]).ok  # on the recorder's clock it would fit in K+1
    report = failing(recs + [behind] + late, "admitted_within_bound")  # but it was admitted in window K
    assert report.worst["p-global"].window_index == K
    # with replicas on different clocks a decision may fall in either window: attributed where it fits
    mixed = TopologyRec(agents=TOPO.agents, allocator_offsets_ms={"allocator-1": -2_000, "allocator-2": 0})
    assert check(recs + [mixed] + late, [POOL]).ok


def test_lost_acknowledged_grant_is_reported():
    recs = [r for r in clean() if not (isinstance(r, EtcdGrant) and r.lease_id == "lease-us-0001")]
    report = failing(recs, "acknowledged_grants_persisted")
    assert report.verdict("acknowledged_grants_persisted").violations[0].lease_id == "lease-us-0001"
    changed = [r for r in clean() if not isinstance(r, EtcdGrant)]
    changed += [etcd(clean()[2], 10), etcd(clean()[3], 11, granted=40)]
    failing(changed, "acknowledged_grants_persisted")


def test_history_file_round_trip_and_check_from_path(tmp_path: Path):
    path = tmp_path / "run.jsonl"
    with HistoryWriter(path) as w:
        w.write_all(clean())
    with open(path, "ab") as f:
        f.write(b'{"type":"decision","agent":"a')  # a run killed mid-write
    assert list(read_history(path)) == clean()
    report = check(path, [POOL])
    assert report.ok and report.counts["decisions"] == 4


def test_malformed_history_line_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"type":"nonsense"}\n{"type":"leader","epoch":1,"node":null,"observedAtMs":1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        check(path, [POOL])


def test_window_end_of_a_lease_is_read_on_the_allocators_clock():
    # the allocators 2 s behind the recorder: the window end 40_000 (allocator clock) is 42_000 here
    long = grant("lease-us-0009", "us", 10, sent=38_000, ttl=15_000)
    spent = spend("us", 41_000, "lease-us-0009", 1)
    recs = [r for r in clean() if not isinstance(r, TopologyRec)] + [long, spent]
    failing(recs + [TOPO], "no_spend_after_expiry")
    behind = TopologyRec(agents=TOPO.agents, allocator_offsets_ms={"allocator-1": -2_000, "allocator-2": -2_000})
    assert check(recs + [behind], [POOL]).verdict("no_spend_after_expiry").ok


# ------------------------------------------------------------------------------- fault-free utilisation
RULE_ID = "global-p"


def decided(k: int, i: int, n: int, *, allowed: bool, by: str | None = RULE_ID, region: str = "eu") -> DecisionRec:
    """The ``i``-th of ``n`` decisions spread over window ``k``, spending the pool (no lease named);
    a denial names the rule that denied it (``by``)."""
    at = k * W + 50 + i * (W - 100) // max(1, n)
    return DecisionRec(agent=f"agent-{region}-1", region=region, tenant="atlas", allowed=allowed, sent_at_ms=at,
                       recorded_at_ms=at + 5, spends=[PoolSpend(pool="p-global", tokens=1, window_index=k,
                                                                rule=RULE_ID)],
                       rule_id=RULE_ID if allowed else by, reason=None if allowed else "RATE_EXCEEDED")


def window_load(k: int, admitted: int, denied: int, denied_elsewhere: int = 0) -> list[DecisionRec]:
    n = admitted + denied + denied_elsewhere
    kinds = [(True, RULE_ID)] * admitted + [(False, RULE_ID)] * denied + [(False, "tenant-atlas")] * denied_elsewhere
    return [decided(k, i, n, allowed=a, by=b) for i, (a, b) in enumerate(kinds)]


def util_history(mid: list[DecisionRec], *extra) -> list:
    """Windows K-1 .. K+1 under load (K-1 and K+1 at the load's edges), window K as given."""
    return [TOPO, *window_load(K - 1, 50, 0), *mid, *window_load(K + 1, 50, 0), *extra]


def test_a_fault_free_window_with_demand_above_g_must_use_97_percent_of_it():
    report = check(util_history(window_load(K, 90, 60)), [POOL])
    v = report.verdict("fault_free_utilisation")
    assert not v.ok and v.checked, report.render()
    (viol,) = v.violations
    assert (viol.pool, viol.window_index, viol.observed, viol.bound) == ("p-global", K, 90, 97)
    assert "0.90 < 0.97" in viol.detail and not report.ok
    assert "utilisation of p-global" in report.render()
    ok = check(util_history(window_load(K, 97, 60)), [POOL])
    assert ok.verdict("fault_free_utilisation").ok and ok.verdict("fault_free_utilisation").checked
    assert [(u.window_index, u.admitted, u.demand, u.touched) for u in ok.utilisation] == [(K, 97, 157, "")]


def test_requests_another_rule_denied_are_not_demand_for_the_pool():
    """A search request the tenant's own pool denied never reached the fleet-wide pool: no pool could
    have admitted it, so it is not demand that pool failed to serve (nor is an overloaded agent's
    shed answer, which names no rule)."""
    report = check(util_history(window_load(K, 80, 15, denied_elsewhere=200)), [POOL])
    v = report.verdict("fault_free_utilisation")
    assert v.ok and not v.checked  # 95 offered to the pool: not above G, not judged
    assert report.utilisation == []
    shed = [msgspec.structs.replace(d, rule_id=None, reason="OVERLOADED") for d in window_load(K, 0, 0, 30)]
    report = check(util_history(window_load(K, 80, 15) + shed), [POOL])
    assert report.verdict("fault_free_utilisation").ok and report.utilisation == []


def test_windows_a_fault_touched_are_reported_not_judged():
    fault = cut("us", K * W - 5_000, K * W - 2_500)  # stopped 2.5 s before K: its grace (3 s) reaches K
    report = check(util_history(window_load(K, 50, 100), fault), [POOL])
    v = report.verdict("fault_free_utilisation")
    assert v.ok and not v.checked, report.render()
    (u,) = report.utilisation
    assert (u.window_index, u.ratio, u.touched) == (K, 0.5, "partition on us->allocator")
    assert "0.50*" in report.render()
    later = cut("us", K * W - 9_000, K * W - 6_000)  # healed more than the grace before K
    assert not check(util_history(window_load(K, 50, 100), later), [POOL]).verdict("fault_free_utilisation").ok


def test_a_window_whose_policy_changed_is_reported_not_judged():
    halved = Policy(version=8, applied_at_ms=K * W + 4_000,
                    pools=[PoolPolicy(id="p-global", limit=50, window_ms=W, fallback_per_region=10)])
    report = check(util_history(window_load(K, 60, 100), halved), [POOL])
    (u,) = report.utilisation
    assert u.touched == "policy change" and report.verdict("fault_free_utilisation").ok


def test_an_admission_between_two_windows_counts_for_either_when_judged():
    """An answer received after a boundary its request was sent before may have been admitted in
    either window: the check counts it in both (a shortfall it reports is certain)."""
    late = [msgspec.structs.replace(d, sent_at_ms=(K + 1) * W - 20, recorded_at_ms=(K + 1) * W + 30)
            for d in window_load(K, 3, 0)]
    mid = window_load(K, 95, 60) + late
    report = check(util_history(mid), [POOL])
    assert report.verdict("fault_free_utilisation").ok, report.render()
    (u,) = [u for u in report.utilisation if u.window_index == K]
    assert u.most == 98 and u.admitted <= 98
    short = check(util_history(window_load(K, 93, 60) + late), [POOL])
    (v,) = short.verdict("fault_free_utilisation").violations
    assert (v.observed, v.bound, v.window_index) == (96, 97, K)  # 93 certain + 3 that may lie in K: still short


def test_failures_no_fault_names_touch_a_window_too():
    """A leader change, or a decision from a fallback allowance, shows the allocator could not serve
    in that window even where no fault was recorded (e.g. etcd settling for seconds after an isolated
    member rejoins): reported, not judged."""
    starved = window_load(K, 50, 100)
    new_leader = [Leader(epoch=5, node="alloc-1", observed_at_ms=1_000),
                  Leader(epoch=9, node="alloc-2", observed_at_ms=K * W + 2_000)]
    report = check(util_history(starved, *new_leader), [POOL])
    (u,) = report.utilisation
    assert u.touched == "leader change (epoch 9)" and report.verdict("fault_free_utilisation").ok
    same = [Leader(epoch=5, node="alloc-1", observed_at_ms=1_000), Leader(epoch=5, node="alloc-1",
                                                                          observed_at_ms=K * W + 2_000)]
    assert not check(util_history(starved, *same), [POOL]).verdict("fault_free_utilisation").ok  # no change
    fb = msgspec.structs.replace(starved[0], fallback=True)
    report = check(util_history([fb, *starved[1:]]), [POOL])
    assert [u.touched for u in report.utilisation] == ["a fallback decision"]


def test_a_windows_limit_is_the_most_generous_from_when_a_prefetch_may_have_made_it():
    """The allocator fixes a window's G at its first grant, which a prefetch makes up to the pool's
    prefetch before the window starts: a limit halved within that time applies from the window
    after; one halved earlier applies to it."""
    old = PoolPolicy(id="p", limit=100, window_ms=4_000, prefetch_ms=500)
    halved_late = PoolPolicy(id="p", limit=50, window_ms=4_000, prefetch_ms=500, valid_from_ms=7_600)
    halved_early = PoolPolicy(id="p", limit=50, window_ms=4_000, prefetch_ms=500, valid_from_ms=7_400)
    assert policy_for_window([old, halved_late], "p", 2).limit == 100  # window 8,000-12,000
    assert policy_for_window([old, halved_late], "p", 3).limit == 50
    assert policy_for_window([old, halved_early], "p", 2).limit == 50
