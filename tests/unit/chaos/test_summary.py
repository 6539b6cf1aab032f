"""``python -m chaos summary``: one row per (scenario, seed), the latest report wins, failing runs
and over-bound windows are marked, the README block is rewritten in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.__main__ import main
from chaos.summary import load_reports, table, write_readme


def report(root: Path, name: str, seed: int, when: str, *, ok: bool = True, admitted: int = 250) -> None:
    d = root / f"{name}-seed{seed}-{when}"
    d.mkdir(parents=True)
    doc = {"scenario": name, "seed": seed, "ok": ok, "unmetExpectations": [] if ok else ["no fallback in eu"],
           "verdicts": [{"invariant": "admitted_within_bound", "ok": admitted <= 264}],
           "worst": {"atlas-w": {"admitted": admitted, "limit": 240, "bound": 264}},
           "utilisation": [{"ratio": 0.9, "judged": False}, {"ratio": 1.05, "judged": True},
                           {"ratio": 0.98, "judged": True}]}
    (d / "report.json").write_text(json.dumps(doc))


def test_table_rows_latest_report_and_marks(tmp_path: Path, capsys) -> None:
    report(tmp_path, "kill-leader", 1, "20261130T100000", ok=False, admitted=300)
    report(tmp_path, "kill-leader", 1, "20261130T110000")  # the later run of the same seed counts
    report(tmp_path, "redis-restart", 2, "20261130T100000", ok=False, admitted=270)
    docs = load_reports(tmp_path)
    assert [(d["scenario"], d["seed"]) for d in docs] == [("kill-leader", 1), ("redis-restart", 2)]
    text = table(docs)
    assert "| `kill-leader` | 1 | +10 / +24 | 0.98 (0.90–1.05) | 0.98 / 0.98 (2) | PASS |" in text
    assert "| `redis-restart` | 2 | +30 / +24 **over** | 0.98 (0.90–1.05) | 0.98 / 0.98 (2) | FAIL: admitted_within_bound, " \
           "expectation: no fallback in eu |" in text
    assert "1 of 2 runs passed" in text
    assert main(["summary", str(tmp_path)]) == 1 and "redis-restart" in capsys.readouterr().out
    assert main(["summary", str(tmp_path / "none")]) == 2


def test_readme_block_is_rewritten(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- generated:chaos-summary -->\nold\n<!-- /generated:chaos-summary -->\ntail\n")
    write_readme(readme, "| new |")
    assert readme.read_text() == "# x\n<!-- generated:chaos-summary -->\n| new |\n<!-- /generated:chaos-summary -->\ntail\n"
    (tmp_path / "bare.md").write_text("no block")
    with pytest.raises(ValueError):
        write_readme(tmp_path / "bare.md", "| new |")
