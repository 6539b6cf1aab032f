"""The RLQS pieces of the chaos suite, short (the whole scenario, ``rlqs-envoys``, runs in
``make chaos``): a real Envoy on the shipped ``envoy-rlqs.yaml`` in front of a chaos topology's
agent, its link to the agent through a fault proxy. Clients are admitted from the quota the agent
assigned; the link blackholed, the Envoy spends what it holds and then denies (the shipped
deny-all, the bound's RLQS term 0); what it decided is read from its own access log into the
history, and the checker judges those admissions against the bound with the RLQS term."""

from __future__ import annotations

import asyncio
from pathlib import Path

from chaos import bundles
from chaos.checker import check
from chaos.history import DecisionRec, HistoryWriter, TopologyRec, now_ms, read_history
from chaos.nemesis import Effects, Partition
from chaos.rlqs import EnvoyLoad, EnvoyTenant, record_decisions, rlqs_record
from chaos.topo import ChaosSpec, ChaosTopology
from tests.support.procs import alive

CUT_S = 9.0  # longer than any assignment can live: a 6 s pool window ends every one funded in it


async def test_an_envoy_cut_off_from_its_agent_denies_once_its_assignment_ends_and_the_checker_counts_it(
        tmp_path: Path) -> None:
    bundle = bundles.chaos_bundle()
    policy = bundles.write(tmp_path / "policy.json", bundle)
    spec = ChaosSpec(run_dir=tmp_path / "run", policy=policy, regions=("eu",), agents={"eu": 1}, allocators=1,
                     etcd_members=1, policy_etcd=False, envoys=(("envoy-eu-a", "agent-eu-1"),))
    topo = ChaosTopology(spec)
    history = HistoryWriter(tmp_path / "history.jsonl")
    load = (EnvoyTenant("atlas", 12.0, users=4, api_key="K1"),)
    try:
        await asyncio.to_thread(topo.start)
        assert topo.envoys is not None and await topo.wait_leader(20.0) is not None
        history.write(TopologyRec(agents={"eu": ["agent-eu-1"]}))
        history.write(rlqs_record(topo.envoys, bundle, load))
        e = topo.envoys.envoys[0]
        assert f"port_value: {e.proxy.port}}}" in e.envoy.config  # the Envoy reaches its agent only through the proxy
        cut = Partition(e.proxy, target=e.proxy.name, recorder=history, effects=Effects(envoys=(e.name,)))

        heal: list[int] = []

        async def fault() -> None:
            await asyncio.sleep(6.0)
            async with cut.active_for():
                await asyncio.sleep(CUT_S)
                heal.append(now_ms())  # the link heals from here; the fault's own stop is stamped after

        driver = EnvoyLoad(topo.envoys, load, seed=1)
        await asyncio.gather(driver.run(6.0 + CUT_S + 5.0), fault())
        pids = [e.envoy.proc.pid, topo.envoys.upstream.pid]
        await asyncio.to_thread(topo.envoys.stop)  # Envoy writes out its access log as it exits
        logged = record_decisions(topo.envoys, bundle, history)[e.name]
    finally:
        await asyncio.to_thread(topo.stop)
        history.close()
    assert not [p for p in pids if alive(p)]
    assert logged["admitted"] >= driver.stats.allowed > 0, (logged, driver.stats)  # every admission is in its log
    assert logged["deniedByQuota"] > 0
    decisions = [r for r in read_history(history.path) if isinstance(r, DecisionRec)]
    assert decisions and all(d.gateway == e.name for d in decisions)
    # cut off: once what it was assigned ended (at its window's end at the latest), nothing was admitted
    assert cut.started_ms is not None and cut.stopped_ms is not None
    # (until the heal began: a loaded machine may fund the healed Envoy before stopped_ms is stamped)
    late = [d for d in decisions if cut.started_ms + 7_000 <= (d.sent_at_ms or 0) and d.recorded_at_ms < heal[0]]
    assert late and not [d for d in late if d.allowed], [(d.sent_at_ms, d.allowed) for d in late][:20]
    # ... and it was funded again once the link healed
    assert any(d.allowed and (d.sent_at_ms or 0) > cut.stopped_ms for d in decisions)
    report = check(history.path, bundle)
    v = report.verdict("admitted_within_bound")
    assert v.checked and v.ok, report.render()
    assert report.counts["envoy_decisions"] == len(decisions)
    assert report.worst["atlas-w"].admitted > 0 and report.worst["atlas-w"].rlqs_allowance == 0
