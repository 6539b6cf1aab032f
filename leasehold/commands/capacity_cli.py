"""``leasehold capacity``: the regional Redis sized for a call rate and an active-key count —
primaries (shards), memory per copy and the hottest key's budget — from measured numbers
(docs/capacity.md, section 6; the arithmetic is leasehold/commands/redis_sizing.py).

    leasehold capacity --calls-per-s 500000 --active-keys 2000000
    leasehold capacity --calls-per-s 50000 --active-keys 300000 --rules 5 --replicas 2 -o json
    leasehold capacity ... --results bench-results/results.json   # this machine's own bench run

Output and exit codes follow the CLI's convention (leasehold/commands/output.py): ``-o json`` prints the
plan as one JSON document; bad input is exit 2 with a one-line message.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import redis_sizing
from .output import Exit, Failure, add_output_option, out


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


def _measured_from(path: Path) -> redis_sizing.Measured:
    """The "redis" figure of a bench results.json (``--results``); a file that is not one is a
    usage error naming it."""
    text = path.read_bytes()  # OSError: the caller names the file
    try:
        results = json.loads(text)
    except ValueError as e:  # not UTF-8, not JSON
        raise ValueError(f"{path} is not a bench results.json: {e}") from None
    try:
        return redis_sizing.from_results(results)
    except (AttributeError, TypeError, KeyError, IndexError) as e:  # JSON of another shape
        raise ValueError(f"{path} is not a bench results.json: {type(e).__name__}: {e}") from None


def _algorithm(text: str) -> str:
    """A rule's ``algorithm`` as the measurement names its keys: a ``pool`` rule's keys are its pool's
    balance (measured as "pool balance", which is also taken)."""
    return "pool balance" if text == "pool" else text


def register(sub: Any) -> None:
    """Add ``capacity`` to the ``leasehold`` command's subparsers."""
    about = ("Redis primaries, memory per copy and the hottest key's budget for a call rate and an active-key "
             "count (measured numbers, docs/capacity.md)")
    sp = sub.add_parser("capacity", help=about, description=about)
    add_output_option(sp)
    sp.add_argument("--calls-per-s", type=_positive, required=True, help="admission calls per second (peak)")
    sp.add_argument("--active-keys", type=_count, required=True, help="rate-limit keys live at once")
    sp.add_argument("--rules", type=int, default=2, choices=range(1, redis_sizing.MAX_RULES + 1), metavar="1..8",
                    help="rules per admission call (one multi-rule script); default 2, Northstar's read")
    sp.add_argument("--algorithm", type=_algorithm, default="token_bucket",
                    help="the keys' algorithm for bytes per key, as a rule names it (token_bucket, gcra, "
                         "fixed_window, sliding_counter, sliding_log, pool: a pool's balance keys), or "
                         "concurrency (a concurrency gate's keys)")
    sp.add_argument("--utilisation", type=_share, default=redis_sizing.DEFAULT_UTILISATION,
                    help="share of a primary's measured budget to plan for (default 0.625)")
    sp.add_argument("--replicas", type=_count, default=1, help="replicas per primary (default 1)")
    sp.add_argument("--results", type=Path, help="a bench results.json with the \"redis\" figure (default: the "
                                                 "measurement shipped with Leasehold)")
    sp.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        if args.results is not None:
            measured = _measured_from(args.results)
        else:
            measured = redis_sizing.shipped()
        p = redis_sizing.plan(measured, calls_per_s=args.calls_per_s, active_keys=args.active_keys, rules=args.rules,
                              algorithm=args.algorithm, utilisation=args.utilisation, replicas=args.replicas)
    except OSError as e:
        raise Failure(Exit.USAGE, f"cannot read {args.results}: {e.strerror}") from None
    except (ValueError, KeyError) as e:
        raise Failure(Exit.USAGE, str(e)) from None
    where = measured.meta
    load = where.get("load_average") or ["?"]
    text = "\n".join([*redis_sizing.describe(p, measured),
                      f"(measured with redis {where.get('redis', '?')}, commit {where.get('commit', '?')}, on a "
                      f"shared {where.get('cpus', '?')}-core machine at a load average up to {load[-1]}: re-measure on "
                      "your own hardware with `python -m bench --only redis` and pass --results)"])
    return out(args).result({"plan": asdict(p), "measured": where}, text)
