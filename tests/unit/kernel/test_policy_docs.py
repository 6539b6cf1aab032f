"""docs/policy.md as shipped: every YAML block compiles, every algorithm has an example there, and
the page names no command the CLI does not have."""

from __future__ import annotations

import re
from pathlib import Path

from kernel.algorithms import ALGORITHMS
from kernel.policy_yaml import compile_text
from leasehold.commands.cli import build_parser

DOC = Path(__file__).resolve().parents[3] / "docs" / "policy.md"
TEXT = DOC.read_text()
BLOCKS = re.findall(r"```yaml\n(.*?)```", TEXT, re.S)


def test_every_yaml_block_compiles_and_every_algorithm_has_an_example():
    assert len(BLOCKS) >= 2
    algorithms = set()
    for i, block in enumerate(BLOCKS):
        bundle = compile_text(block, f"docs/policy.md block {i + 1}")
        algorithms |= {r.algorithm for r in bundle.rules}
    assert algorithms == set(ALGORITHMS)


def test_the_commands_the_page_names_exist():
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # noqa: SLF001
    policy = sub.choices["policy"]
    names = set(next(a for a in policy._subparsers._group_actions).choices)  # noqa: SLF001
    named = set(re.findall(r"`(?:leasehold )?policy ([a-z-]+)", TEXT))
    assert named and named <= names, named - names
