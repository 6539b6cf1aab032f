"""The checker catches each broken invariant in a hand-made history, and passes a clean one."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from chaos.checker import INVARIANTS, check
from chaos.history import (
    Decision,
    EtcdGrant,
    EtcdWindow,
    Fault,
    Grant,
    HistoryWriter,
    Leader,
    LocalAllowance,
    Policy,
    PoolSpend,
    SpendClose,
    read_history,
)
from chaos.invariants import PoolPolicy
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
          local: bool = False, allowed: bool = True, index: int = K) -> Decision:
    return Decision(agent=f"agent-{region}-1", region=region, tenant="atlas", allowed=allowed, recorded_at_ms=at,
                    spends=[PoolSpend(pool="p-global", tokens=tokens, lease_id=lease, window_index=index)],
                    fallback=fallback, local=local, reason=None if allowed else "pool_exhausted")


def clean() -> list:
    g1, g2 = grant("lease-eu-0001", "eu", 50), grant("lease-us-0001", "us", 50, sent=30_100)
    return [
        Leader(epoch=5, node="alloc-1", observed_at_ms=29_000),
        g1, g2,
        spend("eu", 30_200, "lease-eu-0001", 40),
        spend("us", 30_300, "lease-us-0001", 45),
        spend("us", 30_400, None, 15, allowed=False),  # demand above G: denied
        spend("eu", 34_000, None, 5, fallback=True),  # allocator unreachable: fallback
        SpendClose(lease_id="lease-eu-0001", pool="p-global", region="eu", granted=50, spent=40),
        Fault(nemesis="partition", target="eu->allocator", start_ms=33_000, stop_ms=35_000),
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
    assert all(v.checked for v in report.verdicts)
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
    # G 100 + eu fallback allowance 10 = 110; admit 16 more from fallback in us -> us allowance 10 exceeded too
    recs = clean() + [spend("us", 34_500, None, 16, fallback=True)]
    report = failing(recs, "admitted_within_bound")
    w = report.worst["p-global"]
    assert (w.admitted, w.bound, w.overshoot) == (106, 120, 6)
    assert any("us admitted 16 from fallback" in v.detail for v in report.verdict("admitted_within_bound").violations)
    recs = clean() + [spend("us", 30_700, None, 25, local=True)]  # local admissions with no stated allowance
    report = failing(recs, "admitted_within_bound")
    assert report.worst["p-global"].excess == 5


def test_local_allowance_and_policy_change_raise_the_bound():
    extra = [spend("us", 30_700, None, 25, local=True)]
    assert check(clean() + extra + [LocalAllowance(pool="p-global", window_index=K, tokens=25)], [POOL]).ok
    bigger = Policy(version=2, applied_at_ms=36_000,
                    pools=[PoolPolicy(id="p-global", limit=200, window_ms=W, fallback_per_region=10)])
    assert check(clean() + extra + [bigger], [POOL]).ok
    later = msgspec.structs.replace(bigger, applied_at_ms=40_000)  # takes effect only in the next window
    failing(clean() + extra + [later], "admitted_within_bound")


def test_lost_acknowledged_grant_is_reported():
    recs = [r for r in clean() if not (isinstance(r, EtcdGrant) and r.lease_id == "lease-us-0001")]
    report = failing(recs, "acknowledged_grants_persisted")
    assert report.verdict("acknowledged_grants_persisted").violations[0].lease_id == "lease-us-0001"
    changed = [r for r in clean() if not isinstance(r, EtcdGrant)]
    changed += [etcd(clean()[1], 10), etcd(clean()[2], 11, granted=40)]
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
