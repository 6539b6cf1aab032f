"""``leasehold policy validate --bound`` states the approximate rules' bound and the split tenants'
shares, in text and JSON, for a bundle as an operator writes it (the YAML of docs/policy.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kernel.bundle import encode_bundle
from kernel.policy_yaml import compile_text
from leasehold.cli import main

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
