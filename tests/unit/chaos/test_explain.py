"""``python -m chaos fallbacks``: fallback admissions outside every fault's effect are listed with
the agent counters that moved around them; the ones a fault explains are not."""

from __future__ import annotations

from pathlib import Path

from chaos.__main__ import main
from chaos.explain import unexplained
from chaos.history import Counters, DecisionRec, Fault, HistoryWriter, Meta, PoolSpend

AMB = 'leasehold_agent_degraded_decisions_total{fail_mode="local_bounded",reason="AMBIGUOUS"}'


def fb(at: int, region: str = "eu") -> DecisionRec:
    return DecisionRec(agent=f"agent-{region}-1", region=region, tenant="atlas", allowed=True, recorded_at_ms=at,
                    sent_at_ms=at - 300, fallback=True, spends=[PoolSpend(pool="atlas-w")], rule_id="user-all",
                    limit=50, route_group="read")


RECS = [Meta(scenario="x", seed=1, started_at_ms=0),
        Fault(nemesis="partition", target="eu", start_ms=1_000, stop_ms=2_000, allocator_regions=["eu"], grace_ms=500),
        fb(2_400), fb(2_400, "us"), fb(9_000),
        Counters(service="agent-eu-1", at_ms=6_000, values={AMB: 1.0}),
        Counters(service="agent-eu-1", at_ms=9_500, values={AMB: 3.0})]


def test_only_unexplained_fallbacks_are_listed_with_the_counters_that_moved() -> None:
    lines = unexplained(RECS)
    assert len(lines) == 2  # eu at 2.4 s is inside the partition's grace; us at 2.4 s and eu at 9 s are not
    assert lines[0].startswith("   2.40 s agent-us-1") and "none seen" in lines[0]
    assert "9.00 s agent-eu-1 atlas/read pools atlas-w: user-all limit 50, 300 ms" in lines[1]
    assert 'fail_mode="local_bounded",reason="AMBIGUOUS" +2' in lines[1]


def test_cli_exit_codes(tmp_path: Path, capsys) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as w:
        w.write_all(RECS)
    assert main(["fallbacks", "--history", str(path)]) == 1
    clean = tmp_path / "c.jsonl"
    with HistoryWriter(clean) as w:
        w.write_all(RECS[:3])
    assert main(["fallbacks", "--history", str(clean)]) == 0 and "explained" in capsys.readouterr().out
    assert main(["fallbacks", "--history", str(tmp_path / "missing.jsonl")]) == 2
