"""Pure parts of the chaos runner: scenario catalogue, bundles, boundary attribution in the
checker, report series."""

from __future__ import annotations

import pytest

from chaos import bundles
from chaos.checker import check, split_boundary
from chaos.history import Decision, Fault, Policy, PoolSpend
from chaos.invariants import DecisionRecord, PoolPolicy, WindowBound
from chaos.report import fault_spans, pool_series
from chaos.scenarios import PROFILES, SCENARIOS, resolve
from kernel.errors import BadRequest

W = bundles.WINDOW_MS


def test_at_least_ten_scenarios_and_profiles_name_known_ones() -> None:
    assert len(SCENARIOS) >= 10
    for profile in PROFILES.values():
        for name, duration in profile:
            assert resolve(name) and duration >= 5


def test_resolve_combines_and_rejects_unknown() -> None:
    assert [s.name for s in resolve("kill-leader+redis-restart")] == ["kill-leader", "redis-restart"]
    with pytest.raises(BadRequest):
        resolve("kill-leader+nope")
    with pytest.raises(BadRequest):
        resolve("+")


def test_chaos_bundle_pools_and_tightened_version() -> None:
    b = bundles.chaos_bundle()
    tight = bundles.chaos_bundle(version=8, scale=0.5)
    again = bundles.with_version(b, 9)
    assert {p.id: p.limit for p in b.pools} == {"atlas-w": 240, "birch-w": 60}
    assert {p.id: p.limit for p in tight.pools} == {"atlas-w": 120, "birch-w": 30}
    assert again.bundle_version == 9 and again.pools == b.pools and again.checksum == b.checksum


def _d(at: int, index: int) -> DecisionRecord:
    return DecisionRecord(pool="atlas-w", window_index=index, region="eu", allowed=True, at_ms=at)


def test_split_boundary_separates_decisions_answered_in_a_later_window() -> None:
    pools = [PoolPolicy(id="atlas-w", limit=240, window_ms=W)]
    inside, late = _d(5 * W + 10, 5), _d(6 * W + 3, 5)
    certain, straddling = split_boundary([inside, late], pools)
    assert certain == [inside] and straddling == [late]


def _decision(at: int, index: int, tokens: int) -> Decision:
    return Decision(agent="a", region="eu", tenant="atlas", allowed=True, recorded_at_ms=at,
                    spends=[PoolSpend(pool="atlas-w", tokens=tokens, window_index=index)])


def test_overshoot_beyond_bound_is_still_caught_inside_one_window() -> None:
    recs = [Policy(version=7, applied_at_ms=None, pools=[PoolPolicy(id="atlas-w", limit=10, window_ms=W)]),
            _decision(3 * W + 100, 3, 8), _decision(3 * W + 200, 3, 8),
            _decision(4 * W + 5, 3, 50)]  # straddles into window 4: not attributed
    rep = check(recs)
    v = rep.verdict("admitted_within_bound")
    assert not v.ok and v.violations[0].observed == 16
    assert "1 boundary-straddling" in v.note


def test_pool_series_and_fault_spans_are_relative_to_the_run_start() -> None:
    t0 = 10 * W + 1_000
    wins = [WindowBound("atlas-w", 11, 200, 240, 24, 0, 264), WindowBound("atlas-w", 10, 100, 240, 0, 0, 240)]
    s = pool_series(wins, {"atlas-w": W}, t0)["atlas-w"]
    assert s.starts_s == [-1.0, 5.0] and s.admitted == [100, 200] and s.bound == [240, 264]
    spans = fault_spans([Fault(nemesis="kill", target="allocator-1", start_ms=t0 + 2_000, stop_ms=None)], t0,
                        t0 + 9_000)
    assert spans == [(2.0, 9.0, "kill:allocator-1")]


def test_run_cli_lists_and_rejects_bad_input(capsys) -> None:  # type: ignore[no-untyped-def]
    from chaos.__main__ import main

    assert main(["run", "--list"]) == 0
    assert "kill-leader" in capsys.readouterr().out
    for argv in (["run", "--scenario", "nope"], ["run", "--scenario", "kill-leader", "--duration", "1"],
                 ["run", "--profile", "medium"], ["run", "--seeds", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv


def test_local_allowances_cover_every_window_a_redis_fault_touches_per_agent() -> None:
    from types import SimpleNamespace

    from chaos.nemesis import Custom
    from chaos.run import REDIS_GRACE_MS, RunContext, _local_allowances

    topo = SimpleNamespace(agents_in=lambda region: ["a1", "a2"] if region == "eu" else ["b1"])
    ctx = RunContext(topo=topo, history=None, bundle=bundles.chaos_bundle(), duration_s=20, seed=1)  # type: ignore[arg-type]
    n = Custom("redis-restart", "redis", lambda: None)
    n.started_ms, n.stopped_ms = 10 * W + 100, 10 * W + 200  # inside window 10; grace reaches window 10 only
    ctx.redis_faults.append(("eu", n))
    pools = [PoolPolicy(id="atlas-w", limit=240, window_ms=W, fallback_per_region=24),
             PoolPolicy(id="atlas-w", limit=120, window_ms=W, fallback_per_region=12, valid_from_ms=1)]
    got = {(a.pool, a.window_index): a.tokens for a in _local_allowances(ctx, pools)}
    assert got == {("atlas-w", k): 48 for k in range(10, (10 * W + 200 + REDIS_GRACE_MS) // W + 1)}
    assert ctx.is_local("eu", 10 * W + 150) and ctx.is_local("eu", 10 * W + 200 + REDIS_GRACE_MS)
    assert not ctx.is_local("eu", 10 * W + 50) and not ctx.is_local("us", 10 * W + 150)
    assert not ctx.is_local("eu", 10 * W + 201 + REDIS_GRACE_MS)
