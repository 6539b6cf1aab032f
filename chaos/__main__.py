"""``python -m chaos check --history RUN.jsonl --policy BUNDLE.json`` — re-run the checker on a
kept history (e.g. a failing run's). Exit status 0 = every invariant held, 1 = violations,
2 = bad input. (Scenario running, ``python -m chaos run``, is assembled on top of these parts.)"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from allocator.contract.bundle import load_bundle_file
from allocator.contract.errors import PolicyError
from allocator.contract.invariants import DEFAULT_TOLERANCE_MS

from .checker import check
from .history import HistoryError


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check a history file against the invariants")
    c.add_argument("--history", required=True, help="the run's JSON-lines history")
    c.add_argument("--policy", help="the policy bundle in force at the start (its pools give G and fallbacks)")
    c.add_argument("--tolerance-ms", type=int, default=DEFAULT_TOLERANCE_MS,
                   help=f"timing tolerance on the recorder clock (default {DEFAULT_TOLERANCE_MS})")
    c.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    args = ap.parse_args(argv)
    if args.tolerance_ms < 0:
        ap.error("--tolerance-ms must be >= 0")
    try:
        pools = load_bundle_file(args.policy).pools if args.policy else []
        report = check(args.history, pools, args.tolerance_ms)
    except (PolicyError, HistoryError, OSError) as e:
        print(f"error: {getattr(e, 'detail', None) or e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode({"ok": report.ok, "report": report}).decode() + "\n")
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
