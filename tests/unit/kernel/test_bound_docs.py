"""The bound's three readers use the one function: the documents' tables are its output (stale tables
fail here) and ``leasehold policy validate --bound`` prints its terms."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import doc_tables as readme_tables
from leasehold.commands.cli import main

REPO = Path(__file__).resolve().parents[3]


def test_readme_bound_tables_are_generated_from_kernel_bound() -> None:
    assert readme_tables.stale() == [], "run make doc-tables"


def test_a_stale_or_missing_table_is_detected(tmp_path: Path) -> None:
    for rel, _name, _gen in readme_tables.TABLES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((REPO / rel).read_text().replace("**1,200**", "**1,100**"))
    assert readme_tables.stale(tmp_path) == ["docs/bound.md: bound-sample-policy"]
    assert readme_tables.write(tmp_path) == ["docs/bound.md: bound-sample-policy"]
    assert readme_tables.stale(tmp_path) == []
    with pytest.raises(ValueError, match="no <!-- generated:x"):
        readme_tables.render("no markers here", "x", "| t |")


def test_cli_validate_bound_prints_every_term_and_the_total(capsys) -> None:
    policy = str(REPO / "policies" / "northstar-global.json")
    assert main(["policy", "validate", policy, "--bound", "--regions", "2", "--agents-per-region", "2"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("pool atlas-minute"):out.index("pool birch-minute")]
    for line in ("G                         1,000", "carry-over                    0", "lost grants                   0",
                 "regional fallback           200", "in-process                  400", "total                     1,600"):
        assert line in block, block
    assert "allocator unreachable in every region: 1,200" in block
    assert main(["policy", "validate", policy, "--bound", "--markdown"]) == 0
    assert "| `global-read` | global (chunks) | 40,000 / 1 s | 4,000 | 40,000 | 40,000 + 8,000 = **48,000**" \
        in capsys.readouterr().out
    assert main(["policy", "validate", policy, "--bound", "--regions", "0"]) == 2
