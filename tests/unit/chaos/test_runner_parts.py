"""Pure parts of the chaos runner: scenario catalogue, bundles, boundary attribution in the
checker, report series."""

from __future__ import annotations

import pytest

from chaos import bundles
from chaos.checker import check, faults_by_window
from chaos.history import DecisionRec, Fault, Policy, PoolSpend, TopologyRec
from chaos.invariants import PoolPolicy, WindowBound
from chaos.report import fault_spans, pool_series
from chaos.scenarios import (
    FALLBACK_SHOWS_MS,
    PROFILES,
    REDIS_GRACE_MS,
    RLQS_ENVOYS,
    SCENARIOS,
    FallbackIn,
    resolve,
)
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
    assert {p.id: p.limit for p in b.pools} == {"atlas-w": 240, "birch-w": 60, "fleet-g": 100}
    assert {p.id: p.limit for p in tight.pools} == {"atlas-w": 120, "birch-w": 30, "fleet-g": 50}
    shapes = {p.id: (p.global_scope, p.balances, p.local_keys) for p in PoolPolicy.from_bundle(b)}
    assert shapes == {"atlas-w": (False, 1, 1), "birch-w": (False, 1, 1), "fleet-g": (True, 1, 1)}
    assert again.bundle_version == 9 and again.pools == b.pools and again.checksum == b.checksum


def _decision(at: int, index: int, tokens: int) -> DecisionRec:
    return DecisionRec(agent="a", region="eu", tenant="atlas", allowed=True, recorded_at_ms=at,
                    spends=[PoolSpend(pool="atlas-w", tokens=tokens, window_index=index)])


def test_overshoot_beyond_bound_is_caught_and_straddlers_cannot_hide_it() -> None:
    recs = [Policy(version=7, applied_at_ms=None, pools=[PoolPolicy(id="atlas-w", limit=10, window_ms=W)]),
            _decision(3 * W + 100, 3, 8), _decision(3 * W + 200, 3, 8),
            _decision(4 * W + 5, 3, 50)]  # sent in window 3, answered in window 4: in one of them
    rep = check(recs)
    v = rep.verdict("admitted_within_bound")
    assert not v.ok and {x.window_index for x in v.violations} == {3}
    # 10 of the 50 fit in window 4, the rest cannot be placed: shown in window 3
    assert rep.worst["atlas-w"].admitted == 16 + 40 and "1 admission(s) between two windows" in v.note


def test_pool_series_and_fault_spans_are_relative_to_the_run_start() -> None:
    t0 = 10 * W + 1_000
    wins = [WindowBound("atlas-w", 11, 200, 240, 24, 0, 264), WindowBound("atlas-w", 10, 100, 240, 0, 0, 240)]
    s = pool_series(wins, {"atlas-w": W}, t0)["atlas-w"]
    assert s.starts_s == [-1.0, 5.0] and s.admitted == [100, 200] and s.bound == [240, 264]
    spans = fault_spans([Fault(nemesis="kill", target="allocator-1", start_ms=t0 + 2_000, stop_ms=None)], t0,
                        t0 + 9_000)
    assert spans == [(2.0, 9.0, "kill:allocator-1")]


def test_run_cli_lists_and_rejects_bad_input(capsys) -> None:
    from chaos.__main__ import main

    assert main(["run", "--list"]) == 0
    assert "kill-leader" in capsys.readouterr().out
    for argv in (["run", "--scenario", "nope"], ["run", "--scenario", "kill-leader", "--duration", "1"],
                 ["run", "--profile", "medium"], ["run", "--seeds", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv


def test_fault_effects_cover_every_window_they_touch_on_the_allocator_clock() -> None:
    topo = TopologyRec(agents={"eu": ["agent-eu-1", "agent-eu-2"], "us": ["agent-us-1"]})
    faults = [Fault(nemesis="redis-restart", target="redis-eu", start_ms=10 * W + 100, stop_ms=10 * W + 200,
                    redis_agents=["agent-eu-1", "agent-eu-2"], grace_ms=W),  # reaches window 11
              Fault(nemesis="partition", target="us", start_ms=12 * W + 10, stop_ms=None, allocator_regions=["us"]),
              Fault(nemesis="kill", target="agent-eu-2", start_ms=11 * W, stop_ms=11 * W + 50,
                    restarted_agents=["agent-eu-2"])]
    of = faults_by_window(faults, topo, {"atlas-w": W}, (0, 0), end_ms=13 * W)
    assert of("atlas-w", 9).redis_unreachable == {} and of("atlas-w", 9).allocator_unreachable == frozenset()
    assert of("atlas-w", 10).redis_unreachable == {"eu": 2} and not of("atlas-w", 10).allocator_unreachable
    assert of("atlas-w", 11).redis_unreachable == {"eu": 3}  # agent-eu-2 restarted in window 11
    assert of("atlas-w", 12).allocator_unreachable == {"us"} and of("atlas-w", 12).redis_unreachable == {}
    assert of("atlas-w", 13).allocator_unreachable == {"us"}  # still active at the end of the history
    assert of("atlas-w", 14).allocator_unreachable == frozenset()
    assert of("nope", 10).redis_unreachable == {}
    # the allocators 2 s ahead: the Redis fault also touches window 11 ... and window 9 not at all
    ahead = faults_by_window(faults[:1], topo, {"atlas-w": W}, (2_000, 2_000), end_ms=13 * W)
    assert ahead("atlas-w", 9).redis_unreachable == {} and ahead("atlas-w", 11).redis_unreachable == {"eu": 2}


def test_run_context_is_local_uses_the_redis_faults_and_grace() -> None:
    from types import SimpleNamespace

    from chaos.nemesis import Custom
    from chaos.run import REDIS_GRACE_MS, RunContext

    ctx = RunContext(topo=SimpleNamespace(), history=None, bundle=bundles.chaos_bundle(), duration_s=20,  # type: ignore[arg-type]  # a stand-in topology and no history: the function reads neither
                     seed=1)
    n = Custom("redis-restart", "redis", lambda: None)
    n.started_ms, n.stopped_ms = 10 * W + 100, 10 * W + 200
    ctx.redis_faults.append(("eu", n))
    assert ctx.is_local("eu", 10 * W + 150) and ctx.is_local("eu", 10 * W + 200 + REDIS_GRACE_MS)
    assert not ctx.is_local("eu", 10 * W + 50) and not ctx.is_local("us", 10 * W + 150)
    assert not ctx.is_local("eu", 10 * W + 201 + REDIS_GRACE_MS)


def _fake_ctx():
    from types import SimpleNamespace

    from chaos.run import RunContext

    regions = ("eu", "us")
    proxy = lambda name: SimpleNamespace(name=name)  # noqa: E731
    agents = {r: [SimpleNamespace(name=f"agent-{r}-{j}", region=r, redis_proxy=proxy(f"redis-{r}<-agent-{r}-{j}"),
                                  proc=SimpleNamespace(name=f"agent-{r}-{j}"), url="http://x")
                  for j in (1, 2)] for r in regions}
    topo = SimpleNamespace(
        spec=SimpleNamespace(regions=regions),
        region_links={r: [proxy(f"allocator-{i}<-{r}") for i in (1, 2)] for r in regions},
        agents_in=lambda r: agents[r], agent=lambda n: next(a for r in regions for a in agents[r] if a.name == n),
        redis={r: SimpleNamespace(port=6379, proc=None) for r in regions},
        etcd=SimpleNamespace(member_name=lambda i: f"m{i}"), ready_callback=lambda url: None)
    envoys = [SimpleNamespace(name=e, agent=a, proxy=proxy(f"{a}<-{e}")) for e, a in RLQS_ENVOYS]
    topo.envoys = SimpleNamespace(envoys=envoys, by_name=lambda n: next(e for e in envoys if e.name == n))
    return RunContext(topo=topo, history=SimpleNamespace(write=lambda rec: None), bundle=bundles.chaos_bundle(),
                      duration_s=60, seed=1)


ALL, EU2, US2 = {"eu", "us"}, {"agent-eu-1", "agent-eu-2"}, {"agent-us-1", "agent-us-2"}
EXPECTED_EFFECTS = {  # scenario -> (regions cut off from the allocator, agents cut off from Redis, restarted agents)
    "partition-region-allocator": ({"eu"}, set(), set()), "partition-regions-allocator": (ALL, set(), set()),
    "one-way-loss-latency": ({"us"}, set(), set()), "partition-allocator-etcd": (ALL, set(), set()),
    "etcd-member-isolate": (ALL, set(), set()), "partition-agent-redis": (set(), EU2, set()),
    "kill-leader": (ALL, set(), set()), "pause-leader": (ALL, set(), set()),
    "redis-restart": (set(), EU2, set()), "redis-restart-both": (set(), EU2 | US2, set()),
    "redis-pause": (set(), EU2, set()), "redis-pause-both": (set(), EU2 | US2, set()),
    "agent-kill": (set(), set(), {"agent-eu-1"}), "allocator-latency": (set(), set(), set()),
    "clock-offset-allocator-ahead": ({"eu"}, set(), set()), "clock-offset-allocator-behind": ({"us"}, set(), set()),
    "clock-skew-agent": (set(), set(), set()), "lease-replay": (ALL, set(), set()),
    "policy-rollback": (set(), set(), set()),
    # one Redis Cluster primary stopped or killed: every eu agent counts as cut off (the terms are per agent)
    "redis-cluster-pause": (set(), EU2, set()), "redis-cluster-failover": (set(), EU2, set()),
    "rlqs-envoys": ({"eu"}, EU2, {"agent-eu-1"}), "rlqs-envoys-steady": (set(), set(), set()),
}
#: scenario -> Envoys (RLQS) its faults cut off from their agent; every other scenario: none
EXPECTED_ENVOYS = {"rlqs-envoys": {"envoy-eu-a", "envoy-eu-b"}}


@pytest.mark.parametrize("name", sorted(EXPECTED_EFFECTS))
def test_every_scenario_records_what_its_faults_make_unreachable(name: str) -> None:
    """The checker credits fallback allowances only for recorded effects: a nemesis that forgets
    them would fail correct runs, one that claims too much would hide overshoot."""
    steps = SCENARIOS[name].steps(_fake_ctx())
    got = (set().union(*[s.nemesis.effects.allocator_regions for s in steps]),
           set().union(*[s.nemesis.effects.redis_agents for s in steps]),
           set().union(*[s.nemesis.effects.restarted_agents for s in steps]))
    assert got == EXPECTED_EFFECTS[name]
    assert set().union(*[s.nemesis.effects.envoys for s in steps]) == EXPECTED_ENVOYS.get(name, set())
    assert all(s.nemesis.effects.grace_ms > 0 for s in steps
               if s.nemesis.effects.allocator_regions or s.nemesis.effects.redis_agents or s.nemesis.effects.envoys)


def test_every_scenario_has_its_expected_effects_listed() -> None:
    assert set(SCENARIOS) <= set(EXPECTED_EFFECTS) | {"allocator-rebalance"}  # judged by its own checks


def test_the_full_profile_runs_every_scenario_but_the_measurements_named_out_of_it() -> None:
    full = {name for name, _ in PROFILES["full"] if "+" not in name}
    assert full == {name for name, s in SCENARIOS.items() if s.profiled}
    assert "rlqs-envoys-steady" in SCENARIOS and "rlqs-envoys-steady" not in full
    assert SCENARIOS["rlqs-envoys-steady"].steps(_fake_ctx()) == []  # no fault: every window is judged


def _redis_free_stretch_s(cut: tuple[float, float], redis: list[tuple[float, float]], end_s: float) -> float:
    """The longest part of an allocator cut ``(start, stop)`` inside the run with no Redis fault of
    the region active or in its grace (an answer from a fallback there is counted as a local one)."""
    lo, hi = cut[0], min(cut[1], end_s)
    free = [(lo, hi)]
    for a, b in redis:
        b += REDIS_GRACE_MS / 1000
        free = [piece for x, y in free for piece in ((x, min(y, a)), (max(x, b), y)) if piece[1] > piece[0]]
    return max((y - x for x, y in free), default=0.0)


def _fallback_regions(name: str) -> set[str]:
    """The regions whose fallback decisions a profile entry's scenarios expect (``fallback_in``)."""
    return {r for s in resolve(name) for e in s.expect if isinstance(e, FallbackIn) for r in e.regions}


EXPECTING_FALLBACK = sorted({n for n, _d in PROFILES["full"] + PROFILES["short"] if _fallback_regions(n)})


def test_the_profiles_have_scenarios_expecting_fallback() -> None:
    assert "rlqs-envoys" in EXPECTING_FALLBACK  # the check below runs on something


@pytest.mark.parametrize("name", EXPECTING_FALLBACK)
def test_every_seed_cuts_a_region_expecting_fallback_off_long_enough_with_its_redis_reachable(name: str) -> None:
    """A scenario expecting regional fallback decisions (``fallback_in``) must, in the jittered schedule
    of every chaos seed from 1 to 200, cut that region off from the allocators for ``FALLBACK_SHOWS_MS`` inside the
    run while its agents reach their Redis: a shorter stretch lets a correct agent spend its leases
    and deny, and every fallback answer after its Redis is cut counts as a local one."""
    from chaos.run import _jitter

    scenarios = resolve(name)
    regions = _fallback_regions(name)
    durations = {d for n, d in PROFILES["full"] + PROFILES["short"] if n == name} | {30.0}  # 30: the CLI's default
    for duration in sorted(durations):
        ctx = _fake_ctx()
        ctx.duration_s = duration
        steps = [st for s in scenarios for st in s.steps(ctx)]
        for seed in range(1, 201):
            jittered = _jitter(steps, seed, duration)
            for region in regions:
                agents = {g.name for g in ctx.topo.agents_in(region)}
                redis = [(st.at_s, st.at_s + st.duration_s) for st in jittered
                         if agents & set(st.nemesis.effects.redis_agents)]
                longest = max((_redis_free_stretch_s((st.at_s, st.at_s + st.duration_s), redis, duration)
                               for st in jittered if region in st.nemesis.effects.allocator_regions), default=0.0)
                assert longest >= FALLBACK_SHOWS_MS / 1000 - 1e-6, (name, duration, seed, region, round(longest, 2))


def test_jitter_moves_a_group_together_and_leaves_ungrouped_steps_as_before() -> None:
    from chaos.nemesis import Custom, Step
    from chaos.run import _jitter

    n = Custom("x", "y", lambda: None)
    loose = _jitter([Step(10.0, n, 1.0), Step(20.0, n, 1.0), Step(30.0, n, 1.0)], 33, 60.0)
    grouped = _jitter([Step(10.0, n, 1.0), Step(20.0, n, 1.0, group="g"), Step(30.0, n, 1.0, group="g")], 33, 60.0)
    assert grouped[0].at_s == loose[0].at_s and grouped[1].at_s == loose[1].at_s  # the same draws, in order
    assert grouped[2].at_s - grouped[1].at_s == pytest.approx(10.0) and loose[2].at_s - loose[1].at_s != 10.0
