"""Keep the documents' generated tables in step with their one source: the bound tables with
:mod:`kernel.bound` (one formula everywhere), the services' option tables with their settings
fields (:mod:`kernel.options`), the CLI's exit codes with :mod:`leasehold.commands.output`.

    python -m devtools.doc_tables --check   # exit 1 and name the stale tables (a unit test runs this)
    python -m devtools.doc_tables --write   # rewrite them in place (make doc-tables)

Each table sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` markers.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from kernel.bundle import load_bundle_file
from leasehold.commands.bound_report import markdown_table

REPO = Path(__file__).resolve().parent.parent


def _sample_policy() -> str:
    return markdown_table(load_bundle_file(REPO / "policies" / "northstar-global.json"), ["eu", "us"], (1, 2))


def _chaos_bundle() -> str:
    from chaos.bundles import chaos_bundle

    return markdown_table(chaos_bundle(), ["eu", "us"], (1, 2))


def _redis_measured() -> str:
    from leasehold.commands.redis_sizing import markdown_measured

    return markdown_measured()


def _redis_worked() -> str:
    from leasehold.commands.redis_sizing import markdown_worked

    return markdown_worked()


def _agent_options() -> str:
    from kernel.options import markdown_table
    from region_agent.service.settings import ENV_PREFIX, AgentSettings

    return markdown_table(AgentSettings, ENV_PREFIX)


def _allocator_options() -> str:
    from allocator.settings import ENV_PREFIX, AllocatorSettings
    from kernel.options import markdown_table

    return markdown_table(AllocatorSettings, ENV_PREFIX)


def _cli_exit_codes() -> str:
    from leasehold.commands.output import exit_code_table

    return exit_code_table()


#: (document, table name, generator)
TABLES: list[tuple[str, str, Callable[[], str]]] = [
    ("docs/bound.md", "bound-sample-policy", _sample_policy),
    ("chaos/README.md", "bound-chaos-bundle", _chaos_bundle),
    ("region_agent/README.md", "agent-options", _agent_options),
    ("allocator/README.md", "allocator-options", _allocator_options),
    ("docs/cli.md", "cli-exit-codes", _cli_exit_codes),
    ("docs/capacity.md", "redis-measured", _redis_measured),  # leasehold/commands/redis_measured.json, from make bench
    ("docs/capacity.md", "redis-sizing", _redis_worked),
]


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{re.escape(name)} -->\n)(.*?)(<!-- /generated:{re.escape(name)} -->)",
                      re.DOTALL)


def render(text: str, name: str, table: str) -> str:
    pattern = _block(name)
    if not pattern.search(text):
        raise ValueError(f"no <!-- generated:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + table.rstrip("\n") + "\n" + m.group(3), text, count=1)


def stale(root: Path = REPO) -> list[str]:
    out = []
    for rel, name, gen in TABLES:
        text = (root / rel).read_text()
        if render(text, name, gen()) != text:
            out.append(f"{rel}: {name}")
    return out


def write(root: Path = REPO) -> list[str]:
    changed = []
    for rel, name, gen in TABLES:
        path = root / rel
        text = path.read_text()
        new = render(text, name, gen())
        if new != text:
            path.write_text(new)
            changed.append(f"{rel}: {name}")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.doc_tables")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true")
    g.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for b in bad:
            print(f"stale generated table: {b} (run make doc-tables)", file=sys.stderr)
        return 1 if bad else 0
    for c in write():
        print(f"rewrote {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
