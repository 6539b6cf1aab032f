"""``python -m chaos check --history RUN.jsonl --policy BUNDLE.json`` — re-run the checker on a
kept history (e.g. a failing run's). Exit status 0 = every invariant held, 1 = violations,
2 = bad input.

``python -m chaos run --scenario NAME --seed N --duration S`` / ``--profile short|full`` —
run scenarios against the real topology (:mod:`chaos.run`); exit 1 when a checker verdict or a
scenario expectation fails.

``python -m chaos summary REPORT_DIR [--readme chaos/README.md]`` — the scenario x seed table
(:mod:`chaos.summary`); exit 1 when a run in it failed.

``python -m chaos fallbacks --history RUN.jsonl`` — fallback admissions no recorded fault explains,
with the agent counters that moved around each (:mod:`chaos.explain`)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import msgspec

from chaos.invariants import DEFAULT_TOLERANCE_MS
from kernel.bundle import load_bundle_file
from kernel.errors import BadRequest, PolicyError

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
    r = sub.add_parser("run", help="run a scenario (or a profile) against the real topology")
    r.add_argument("--scenario", help="scenario name, or several joined with '+' (combined); default: the profile")
    r.add_argument("--profile", choices=("short", "full"), help="run every scenario of a profile")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--seeds", type=int, default=1, help="run each scenario with this many seeds (seed, seed+1, ...)")
    r.add_argument("--duration", type=float, help="seconds per scenario (default: the profile's)")
    r.add_argument("--out", default="chaos-reports", help="report root directory")
    r.add_argument("--list", action="store_true", help="list the scenarios and exit")
    m = sub.add_parser("summary", help="a Markdown table (scenario x seed) over a directory of reports")
    m.add_argument("reports", help="the report root, e.g. chaos-reports")
    m.add_argument("--readme", help="write the table into this README's chaos-summary block instead of printing")
    x = sub.add_parser("fallbacks", help="admissions not paid by a lease that no recorded fault explains")
    x.add_argument("--history", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "fallbacks":
        from .explain import unexplained
        from .history import read_history

        try:
            lines = unexplained(read_history(args.history))
        except (HistoryError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines) if lines else "every fallback admission is explained by a recorded fault")
        return 1 if lines else 0
    if args.cmd == "run":
        return _run(ap, args)
    if args.cmd == "summary":
        return _summary(args)
    if args.tolerance_ms < 0:
        ap.error("--tolerance-ms must be >= 0")
    try:
        policy = load_bundle_file(args.policy) if args.policy else []
        report = check(args.history, policy, args.tolerance_ms)
    except (PolicyError, HistoryError, OSError) as e:
        print(f"error: {getattr(e, 'detail', None) or e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode({"ok": report.ok, "report": report}).decode() + "\n")
    else:
        print(report.render())
    return 0 if report.ok else 1


def _summary(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .summary import load_reports, table, write_readme

    docs = load_reports(Path(args.reports))
    if not docs:
        print(f"error: no reports under {args.reports}", file=sys.stderr)
        return 2
    text = table(docs)
    if args.readme:
        try:
            write_readme(Path(args.readme), text)
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        print(text)
    return 0 if all(d.get("ok") for d in docs) else 1


def _run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from .run import run_scenario
    from .scenarios import PROFILES, SCENARIOS, resolve

    if args.list:
        for name, s in SCENARIOS.items():
            print(f"{name:30s} {s.doc}")
        return 0
    if args.duration is not None and not (5 <= args.duration <= 1800):
        ap.error("--duration must be in [5, 1800] s")
    if not (1 <= args.seeds <= 100):
        ap.error("--seeds must be in [1, 100]")
    if args.scenario:
        try:
            resolve(args.scenario)
        except BadRequest as e:
            ap.error(e.detail or str(e))
        plan = [(args.scenario, args.duration or 30.0)]
    else:
        plan = [(n, args.duration or d) for n, d in PROFILES[args.profile or "short"]]

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwind: the run's finally blocks stop every process by PID

    signal.signal(signal.SIGTERM, _term)

    # absolute: the services run in their own directories and are given file paths under it
    out_root = Path(args.out).resolve()

    async def go() -> bool:
        ok = True
        for seed in range(args.seed, args.seed + args.seeds):
            for name, dur in plan:
                res = await run_scenario(name, seed, dur, out_root)
                ok = ok and res.ok
        return ok

    return 0 if asyncio.run(go()) else 1


if __name__ == "__main__":
    sys.exit(main())
