"""``leasehold policy validate --bound`` states the approximate rules' bound and the split tenants'
shares, in text and JSON, for a bundle as an operator writes it (the YAML of docs/policy.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kernel.bundle import encode_bundle
from kernel.policy_yaml import compile_text
from leasehold.commands.cli import main

DOC = (Path(__file__).resolve().parents[3] / "docs" / "policy.md").read_text()
BLOCKS = re.findall(r"```yaml\n(.*?)```", DOC, re.S)


def _bundle_file(tmp_path: Path, marker: str) -> str:
    block = next(b for b in BLOCKS if marker in b)
    path = tmp_path / "b.json"
    path.write_bytes(encode_bundle(compile_text(block, "docs/policy.md")))
    return str(path)


def test_the_approximate_rules_bound_is_printed(tmp_path: Path, capsys):
    path = _bundle_file(tmp_path, "approximate:")
    assert main(["policy", "validate", path, "--bound", "--agents-per-region", "3"]) == 0
    out = capsys.readouterr().out
    assert "approximate rules, per key and window, 3 agent process(es)" in out
    assert "100,000 + (3 agent process(es) - 1) x localMax 2,000 = 104,000" in out
    assert "20,000 + (3 agent process(es) - 1) x localMax 200 = 20,400" in out
    assert main(["policy", "validate", path, "--bound", "--agents-per-region", "3", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(a["rule"], a["total"], a["agents"]) for a in doc["approximate"]] == [
        ("tenant-ceiling", 104_000, 3), ("route-ceiling", 20_400, 3)]


def test_the_split_tenants_shares_are_printed(tmp_path: Path, capsys):
    path = _bundle_file(tmp_path, "tenantSplits:")
    assert main(["policy", "validate", path, "--bound"]) == 0
    out = capsys.readouterr().out
    assert ("tenant atlas, rule tenant-atlas-minute: 1,000 split 4 ways (shares 250..250); one principal at most "
            "250; tenant total at most 1,000, at least 1,000 with every sub-bucket busy") in out
    assert main(["policy", "validate", path, "--bound", "-o", "json"]) == 0
    (split,) = json.loads(capsys.readouterr().out)["splits"]
    assert (split["tenant"], split["k"], split["shares"], split["principalMax"], split["totalMax"],
            split["totalMinBusy"]) == ("atlas", 4, [250, 250, 250, 250], 250, 1_000, 1_000)


def test_explain_shows_an_approximate_rules_key_and_that_it_needs_no_store_call(tmp_path: Path, capsys):
    path = _bundle_file(tmp_path, "approximate:")
    assert main(["policy", "explain", path, "--tenant", "atlas", "--principal", "U-1", "--route", "search"]) == 0
    out = capsys.readouterr().out
    assert ("approximate rule route-ceiling: counted in this agent process, no store call per request; reconciled "
            "every 500 ms with rl:v3:{t:atlas}:route:atlas:search:approx (tag {t:atlas} slot 4037)") in out
    assert "no store call" in out and "multi_rule.lua" not in out


def test_explain_shows_a_split_tenants_sub_bucket_tag(tmp_path: Path, capsys):
    path = _bundle_file(tmp_path, "tenantSplits:")
    assert main(["policy", "explain", path, "--tenant", "atlas", "--principal", "U-1", "--route", "read", "-o",
                 "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (tag,) = doc["call"]["hashTags"]
    assert re.fullmatch(r"t:atlas:[0-3]", tag) and doc["call"]["sameSlot"] is True
