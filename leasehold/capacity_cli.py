"""``leasehold capacity``: the regional Redis sized for a call rate and an active-key count —
primaries (shards), memory per copy and the hottest key's budget — from measured numbers
(docs/capacity.md, section 6; the arithmetic is leasehold/redis_sizing.py).

    leasehold capacity --calls-per-s 500000 --active-keys 2000000
    leasehold capacity --calls-per-s 50000 --active-keys 300000 --rules 5 --replicas 2 --json
    leasehold capacity ... --results bench-results/results.json   # this machine's own bench run
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import redis_sizing


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number")
    return v


def _count(text: str) -> int:
    try:
        v = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return v


def _share(text: str) -> float:
    v = _positive(text)
    if v > 1:
        raise argparse.ArgumentTypeError("a share of a primary's budget, in (0, 1]")
    return v


def register(sub: Any) -> None:
    """Add ``capacity`` to the ``leasehold`` command's subparsers."""
    sp = sub.add_parser("capacity", help="Redis primaries, memory per copy and the hottest key's budget for a call "
                                         "rate and an active-key count (measured numbers, docs/capacity.md)")
    sp.add_argument("--calls-per-s", type=_positive, required=True, help="admission calls per second (peak)")
    sp.add_argument("--active-keys", type=_count, required=True, help="rate-limit keys live at once")
    sp.add_argument("--rules", type=int, default=2, choices=range(1, redis_sizing.MAX_RULES + 1), metavar="1..8",
                    help="rules per admission call (one multi-rule script); default 2, Northstar's read")
    sp.add_argument("--algorithm", default="token_bucket", help="the keys' algorithm for bytes per key "
                                                                "(token_bucket, gcra, fixed_window, sliding_counter, "
                                                                "sliding_log, concurrency, pool balance)")
    sp.add_argument("--utilisation", type=_share, default=redis_sizing.DEFAULT_UTILISATION,
                    help="share of a primary's measured budget to plan for (default 0.625)")
    sp.add_argument("--replicas", type=_count, default=1, help="replicas per primary (default 1)")
    sp.add_argument("--results", type=Path, help="a bench results.json with the \"redis\" figure (default: the "
                                                 "measurement shipped with Leasehold)")
    sp.add_argument("--json", action="store_true", help="the plan as JSON")
    sp.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        if args.results is not None:
            measured = redis_sizing.from_results(json.loads(args.results.read_text()))
        else:
            measured = redis_sizing.shipped()
        p = redis_sizing.plan(measured, calls_per_s=args.calls_per_s, active_keys=args.active_keys, rules=args.rules,
                              algorithm=args.algorithm, utilisation=args.utilisation, replicas=args.replicas)
    except (OSError, ValueError, KeyError) as e:
        print(f"leasehold capacity: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plan": asdict(p), "measured": measured.meta}, indent=2))
        return 0
    for line in redis_sizing.describe(p, measured):
        print(line)
    print(f"(measured on {len(measured.cpu_us)} scripts with redis {measured.meta.get('redis', '?')}, "
          f"commit {measured.meta.get('commit', '?')}, on a shared {measured.meta.get('cpus', '?')}-core machine "
          f"whose load average was {max(measured.meta.get('load_average', [0]) or [0])} or less: re-measure on "
          "your own hardware with `python -m leasehold.bench --only redis` and pass --results)")
    return 0
