"""Every ``# type: ignore`` says why: a ``[code]`` and a comment after it, on the same line
(the strict type check also reports one that is no longer needed: ``warn_unused_ignores``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<code>\[[^\]]*\])?(?P<rest>.*)$")
SKIP = {".venv", ".git", "build", "dist", ".mypy_cache"}


def unexplained(line: str) -> bool:
    m = IGNORE.search(line)
    return bool(m) and not (m.group("code") and re.match(r"\s*#\s*\S", m.group("rest")))


def test_every_type_ignore_carries_a_reason() -> None:
    files = [p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts) and p != Path(__file__).resolve()]
    assert ROOT / "region_agent" / "decision" / "engine.py" in files and ROOT / "allocator" / "app.py" in files
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in files
           for i, line in enumerate(p.read_text().splitlines(), 1) if unexplained(line)]
    assert not bad, f"a type: ignore without a [code] and a reason: {bad}"


def test_the_check_can_fail() -> None:
    assert unexplained("x = 1  # type: ignore")
    assert unexplained("x = 1  # type: ignore[arg-type]")
    assert not unexplained("x = 1  # type: ignore[arg-type]  # the fake stands in for redis-py")
