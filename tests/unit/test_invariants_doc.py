"""docs/invariants.md is the one list of invariants: every reference to it names an invariant
it has, every test it cites exists, and no comment points to a document the repository lacks."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "invariants.md"
HEADING = re.compile(r"^### (I\d+) — ", re.M)
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
REFERENCE = re.compile(r"docs/invariants\.md((?:[ ,/]+I\d+)+)")
# pointers to documents that are not in the repository (the reference design, the design brief)
FOREIGN = re.compile(r"\bseed ch(apter|\.) ?\d|\bDESIGN (I\d|invariant)|\bDESIGN\.md|\bseed P-[A-Z]|\bseed [IF]\d")
SOURCES = (".py", ".md", ".lua", ".yml", ".yaml", ".conf", ".sh", ".env", ".toml", ".cfg")
SKIP = {".venv", ".git", "node_modules", "build", "dist", "chaos-reports", "bench-results", ".pytest_cache"}


def repo_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if rel.parts[0] in SKIP or any(part.endswith(".egg-info") for part in rel.parts):
            continue
        if p.is_file() and (p.suffix in SOURCES or p.name in ("Makefile", "Dockerfile")):
            out.append(p)
    return out


def invariants() -> set[str]:
    return set(HEADING.findall(DOC.read_text()))


@cache
def _test_functions_of(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(n for n in names if n.startswith("test_"))


def test_the_list_is_numbered_one_to_n_without_gaps() -> None:
    numbers = [int(i[1:]) for i in HEADING.findall(DOC.read_text())]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 19


def test_every_invariant_names_at_least_one_test_and_every_cited_test_exists() -> None:
    text = DOC.read_text()
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    missing = []
    for section in sections:
        ids = TEST_ID.findall(section)
        assert ids, f"section {section.splitlines()[0]!r} cites no test"
        for file, name in ids:
            path = REPO / file
            if not path.is_file() or name not in _test_functions_of(path):
                missing.append(f"{file}::{name}")
    assert not missing, f"docs/invariants.md cites tests that do not exist: {missing}"


def test_every_reference_names_an_existing_invariant() -> None:
    known = invariants()
    bad, seen = [], 0
    for path in repo_files():
        for m in REFERENCE.finditer(path.read_text(errors="replace")):
            for ref in re.findall(r"I\d+", m.group(1)):
                seen += 1
                if ref not in known:
                    bad.append(f"{path.relative_to(REPO)}: {ref}")
    assert seen > 0  # the references exist (this check is not vacuous)
    assert not bad, f"references to invariants that docs/invariants.md does not have: {bad}"


def test_the_checks_catch_a_bad_reference_and_a_missing_test(tmp_path: Path) -> None:
    assert REFERENCE.search("see docs/invariants.md I6, I8").group(1).split(",")[-1].strip() == "I8"
    assert "I99" not in invariants()
    fake = tmp_path / "test_x.py"
    fake.write_text("def test_a():\n    assert True\n\nclass TestB:\n    def test_c(self):\n        assert True\n")
    assert _test_functions_of(fake) == {"test_a", "test_c"}
