"""docs/hot-path.md stays true: every test it names exists, and every module-level memo of the
services' code (a function under ``lru_cache``, a module-level ``BoundedMemo`` / ``LRU`` or an
empty dict filled at run time) is listed there (a memo a module holds is shared by every agent of
the process: the page says why each one may be)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "hot-path.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)`|`(tests/[\w/]+\.py)`")
MEMO_CALLS = {"BoundedMemo", "LRU"}
# registries filled at import (each algorithm registers itself), not memos filled by requests
REGISTRIES = {"kernel.algorithms.common.KINDS", "kernel.algorithms.rule.ALGORITHMS"}


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file, test name or None) of every test the page names; ``::name`` is in the file named before it."""
    out: list[tuple[str, str | None]] = []
    current = ""
    for m in TEST_REF.finditer(text):
        if m.group(3):
            out.append((m.group(3), None))
            continue
        current = m.group(1) or current
        out.append((current, m.group(2)))
    return out


def module_memos(package: str) -> list[str]:
    """``module.name`` of every module-level memo under ``package``."""
    found: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                    if name in ("lru_cache", "cache"):
                        found.append(f"{module}.{node.name}")
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                memo = (isinstance(value, ast.Dict) and not value.keys) or (
                    isinstance(value, ast.Call) and getattr(value.func, "id", "") in MEMO_CALLS)
                if memo:
                    found += [f"{module}.{t.id}" for t in targets if isinstance(t, ast.Name)]
    return found


def test_every_test_the_page_names_exists():
    refs = named_tests(PAGE.read_text())
    assert len(refs) >= 12
    missing = [f"{f}::{n}" for f, n in refs
               if not (ROOT / f).is_file() or (n is not None and not re.search(
                   rf"^(async )?def {n}\(", (ROOT / f).read_text(), re.M))]
    assert not missing, missing


def test_every_module_level_memo_is_on_the_page():
    text = PAGE.read_text()
    memos = module_memos("region_agent") + module_memos("kernel")
    assert "region_agent.decision.keys.parse_ip" in memos  # the scan finds them
    unlisted = [m for m in memos if f"`{m}`" not in text and m not in REGISTRIES]
    assert not unlisted, f"module-level memos not in docs/hot-path.md: {unlisted}"


def test_the_scan_finds_each_kind():
    assert named_tests("`tests/a.py::x`, `::y` and `tests/b.py`") == [("tests/a.py", "x"), ("tests/a.py", "y"),
                                                                     ("tests/b.py", None)]
