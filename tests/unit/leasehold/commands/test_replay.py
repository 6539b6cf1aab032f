"""Offline replay of the decision log through a bundle, on logs written here: the numbers a token
bucket gives at the logged times, a tightened rule denying more, and sampled lines weighed."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kernel.bundle import load_bundle_file, seal
from leasehold.commands import replay as rp
from leasehold.commands.cli import main

ROOT = Path(__file__).resolve().parents[4]
NS = load_bundle_file(str(ROOT / "policies" / "northstar.json"))
T0 = 1_767_225_600_000


def line(i: int, ts: int, *, outcome="allowed", rule="read-user-v3", rate=1.0, principal="aa11bb22cc33dd44",
         route="read", tenant="atlas", region="eu") -> dict:
    return {"ts": ts, "id": f"r-{i:016d}", "region": region, "agent": "agent-eu-1", "tenant": tenant, "type": "user",
            "principal": principal, "apiKey": None, "route": route, "cost": 1,
            "rules": ["read-user-v3", "tenant-atlas-minute"], "rule": rule, "outcome": outcome,
            "reason": None if outcome == "allowed" else "RATE_EXCEEDED", "fallback": False, "version": 42,
            "rate": rate}


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def tightened(burst: int):
    rules = [msgspec.structs.replace(r, capacity_millis=burst * 1000) if r.id == "read-user-v3" else r
             for r in NS.rules]
    return seal(msgspec.structs.replace(NS, bundle_version=43, rules=rules))


def test_the_token_bucket_at_the_logged_times():
    # 30 requests of one user within 290 ms: P-READ's 20-token burst admits 20 (refill adds 0 in 290 ms... +0)
    lines = [msgspec.convert(line(i, T0 + 10 * i), rp.Line) for i in range(30)]
    events = rp.expand(lines)
    assert len(events) == 30
    cur = rp.replay(NS, events, "current")
    assert cur.rules["read-user-v3"].evaluated == 30 and cur.rules["read-user-v3"].denied == 10
    assert cur.rules["tenant-atlas-minute"].denied == 0
    new = rp.replay(tightened(10), events, "new")
    assert new.rules["read-user-v3"].denied == 20
    # regions keep their own buckets: the same caller in two regions has two
    two = [msgspec.convert(line(i, T0 + 10 * i, region="eu" if i % 2 else "us"), rp.Line) for i in range(30)]
    assert rp.replay(NS, rp.expand(two), "x").rules["read-user-v3"].denied == 0


def test_sampled_lines_stand_for_1_over_rate_questions_spread_since_the_callers_previous_line():
    # one line per second at rate 0.1: 10 questions per second, i.e. 10/s against a 2/s refill
    lines = [msgspec.convert(line(i, T0 + 1000 * i, rate=0.1), rp.Line) for i in range(20)]
    events = rp.expand(lines)
    assert len(events) == 200
    assert sorted({e.ts for e in events if e.line.id == "r-0000000000000005"}) == [
        T0 + 4000 + 100 * k for k in range(1, 11)]
    res = rp.replay(NS, events, "x")
    # 20 s at 10/s = 200 questions; admitted ~ 20 burst + 2/s x ~19 s
    assert 50 <= res.rules["read-user-v3"].denied <= 150
    obs = rp.observed(lines)
    assert obs.questions == 200 and obs.rules["read-user-v3"].evaluated == 200


def test_cli_flags_the_tightened_rule_and_exits_8(tmp_path: Path, capsys):
    log = write(tmp_path / "d.jsonl", [line(i, T0 + 10 * i, outcome="allowed" if i < 20 else "denied")
                                       for i in range(30)] + [{"not": "a decision"}])
    new = tmp_path / "new.json"
    new.write_bytes(__import__("kernel.bundle", fromlist=["encode_bundle"]).encode_bundle(tightened(10)))
    assert main(["policy", "replay", str(new), "--log", str(log), "--against", str(ROOT / "policies" /
                                                                                    "northstar.json"),
                 "-o", "json"]) == 8
    doc = json.loads(capsys.readouterr().out)
    rows = {r["rule"]: r for r in doc["rules"]}
    assert rows["read-user-v3"]["current"] == 10 / 30 and rows["read-user-v3"]["new"] == 20 / 30
    assert rows["read-user-v3"]["observed"] == 10 / 30 and rows["read-user-v3"]["flag"] == "up"
    assert rows["tenant-atlas-minute"]["flag"] is None and doc["unreadable"] == 1
    # against the recorded outcomes, the same bundle: nothing flagged
    assert main(["policy", "replay", str(ROOT / "policies" / "northstar.yaml"), "--log", str(log)]) == 0
    assert "read-user-v3" in capsys.readouterr().out
    assert main(["policy", "replay", str(new), "--log", str(tmp_path / "missing.jsonl")]) == 2


def test_a_line_whose_principal_is_no_identity_text_is_unreadable_not_a_traceback(tmp_path: Path, capsys):
    """A hand-edited line whose principal or API key id no door would take (a space at either end, a
    control character, empty, longer than 256 characters) is counted unreadable, as a line that is not a decision line is."""
    bad = [line(100, T0 + 5, principal=" aa11"), line(101, T0 + 6, principal="aa\x0011"), line(102, T0 + 7, principal=""),
           {**line(103, T0 + 8), "apiKey": "k1 "}, {**line(104, T0 + 9), "type": "anonymous", "principal": "not-hex"},
           line(105, T0 + 11, principal="a" * 257), {**line(106, T0 + 12), "apiKey": "k" * 257}]  # longer than a door takes
    anonymous = {**line(99, T0 + 4, route="login"), "type": "anonymous", "principal": "aa11bb22cc33dd44"}  # as logged
    log = write(tmp_path / "d.jsonl", [line(i, T0 + 10 * i) for i in range(5)] + [anonymous] + bad)
    lines, unreadable = rp.read_log([log])
    assert len(lines) == 6 and unreadable == 7
    assert main(["policy", "replay", str(ROOT / "policies" / "northstar.yaml"), "--log", str(log), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["unreadable"] == 7
