"""The sampled decision log: per-outcome sample rates, never a principal in the file, a bound in
bytes per second, rotation by size, and nothing at all when it is off."""

from __future__ import annotations

import json
from pathlib import Path

from kernel.bundle import load_bundle_file
from region_agent.decision.engine import DecisionEngine
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.negcache import NegativeCache
from region_agent.decision.plan import Snapshot
from region_agent.models import AdmitRequest, Principal
from region_agent.service.decision_log import DecisionLog
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock
from tests.support.scripted_store import ScriptedStore

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
SNAP = Snapshot(NORTHSTAR)
ALLOW = [1, 0, 0, 17_000, 900_000]
DENY = [0, 1, 500, 0, 900_000]


def make(tmp_path: Path, replies, **kw) -> tuple[DecisionEngine, DecisionLog, AgentMetrics, FakeClock]:
    m = AgentMetrics()
    c = FakeClock(1_000.0)
    keys = KeyBuilder(b"unit-pepper")
    dl = DecisionLog(str(tmp_path / "decisions.jsonl"), keys=keys, region="eu", agent="agent-eu-1", metrics=m,
                     wall_clock=lambda: 1.7e9 + c.t, clock=c, **kw)
    e = DecisionEngine(get_snapshot=lambda: SNAP, keys=keys, store=ScriptedStore(*[[r] for r in replies]), metrics=m, clock=c,
                       wall_clock=lambda: c.t + 1.7e9, negative=NegativeCache(cap_ms=0), decision_log=dl)
    return e, dl, m, c


def req(i: int, user: str = "U-17") -> AdmitRequest:
    return AdmitRequest(request_id=f"r-{i:016d}", tenant_id="atlas",
                        principal=Principal(type="user", id=user, api_key_id="K1-secret"), route_group="read")


def lines(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]


async def test_a_line_per_sampled_decision_with_the_hash_never_the_principal(tmp_path: Path):
    e, dl, m, _ = make(tmp_path, [ALLOW, DENY], allow_rate=1.0)
    await e.admit(req(1))
    await e.admit(req(2))
    dl.close()
    a, d = lines(tmp_path)
    assert list(a) == ["ts", "id", "region", "agent", "tenant", "type", "principal", "apiKey", "route", "cost", "rules",
                       "rule", "outcome", "reason", "fallback", "version", "rate"]
    assert (a["id"], a["outcome"], a["rule"], a["version"], a["rate"]) == ("r-0000000000000001", "allowed",
                                                                          "read-user-v3", 42, 1.0)
    assert a["rules"] == ["read-user-v3", "tenant-atlas-minute"] and a["route"] == "read" and a["tenant"] == "atlas"
    assert (d["outcome"], d["rule"], d["reason"]) == ("denied", "read-user-v3", "RATE_EXCEEDED")
    keys = KeyBuilder(b"unit-pepper")
    assert a["principal"] == keys.h("atlas", "u", "U-17") == d["principal"]
    raw = (tmp_path / "decisions.jsonl").read_text()
    assert "U-17" not in raw and "K1-secret" not in raw
    assert m.registry.get_sample_value("leasehold_agent_decision_log_lines_total", {"result": "written"}) == 2


async def test_separate_rates_for_allows_and_denials(tmp_path: Path):
    draws = iter([0.5, 0.005, 0.5, 0.999])  # allows at 0.01: the first is not sampled, the second is

    e, dl, _, _ = make(tmp_path, [ALLOW, ALLOW, DENY, DENY], allow_rate=0.01, deny_rate=1.0)
    dl.sample = lambda: next(draws)
    for i in range(4):
        await e.admit(req(i))
    dl.close()
    got = lines(tmp_path)
    assert [(x["outcome"], x["rate"]) for x in got] == [("allowed", 0.01), ("denied", 1.0), ("denied", 1.0)]


async def test_bounded_bytes_per_second_and_rotation(tmp_path: Path):
    e, dl, m, c = make(tmp_path, [ALLOW] * 401, allow_rate=1.0, bytes_per_s=2_048, max_bytes=65_536, backups=2)
    for i in range(20):
        await e.admit(req(i))
    written = m.registry.get_sample_value("leasehold_agent_decision_log_lines_total", {"result": "written"})
    dropped = m.registry.get_sample_value("leasehold_agent_decision_log_lines_total", {"result": "dropped"})
    assert written + dropped == 20 and 4 <= written <= 8  # ~2 KiB in one instant: a few ~330-byte lines
    assert (tmp_path / "decisions.jsonl").stat().st_size <= 2_048
    c.t += 1.0  # a second later the budget is back
    await e.admit(req(100))
    assert m.registry.get_sample_value("leasehold_agent_decision_log_lines_total", {"result": "written"}) == written + 1
    # rotation by size: many seconds of lines at the full budget
    for i in range(380):
        c.t += 0.2
        await e.admit(req(200 + i))
    dl.close()
    import os
    files = sorted(n for n in os.listdir(tmp_path) if n.startswith("decisions.jsonl"))
    assert files == ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"]
    assert all((tmp_path / f).stat().st_size <= 65_536 for f in files)


async def test_off_by_default_nothing_is_built(tmp_path: Path, monkeypatch):
    from region_agent.service.settings import load_agent_settings
    s = load_agent_settings(["--insecure-dev-pepper", "--auth-disabled"], env={})
    assert s.decision_log is None and DecisionLog.from_settings(s, KeyBuilder(b"x")) is None
    on = load_agent_settings(["--decision-log", str(tmp_path / "d.jsonl"), "--decision-log-allow-rate", "0.5",
                              "--agent-id", "a-1", "--auth-disabled"], env={})
    dl = DecisionLog.from_settings(on, KeyBuilder(b"x"))
    assert dl is not None and dl.allow_rate == 0.5 and dl.agent == "a-1"
    dl.close()
