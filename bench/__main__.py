"""``python -m bench [--quick] [--only FIGURE ...] [--out DIR]`` — run the figures of
README.md beside this file, each against its ceiling measured in the same run; print the table and write
results.json, results.md and fig2-concurrency.png under DIR (default bench-results/)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from . import (
    fig_alloc,
    fig_batch,
    fig_gateways,
    fig_hotchunk,
    fig_hotkey,
    fig_library,
    fig_redis,
    fig_scale,
    fig_shards,
    fig_single,
    fig_util,
)
from .bounds import explain
from .context import Ctx
from .report import environment, plot_fig2, write_json, write_markdown
from .stats import Row, render_text

FIGURES: dict[str, list[Callable[[Ctx], list[Row]]]] = {
    "1": [fig_batch.run], "2": [fig_single.run], "3": [fig_library.run], "4": [fig_alloc.run],
    "5": [fig_hotkey.run], "6": [fig_util.run], "7": [fig_scale.run, fig_alloc.run_scale],
    "8": [fig_gateways.run], "shards": [fig_shards.run], "redis": [fig_redis.run],
    "hotchunk": [fig_hotchunk.run],
}


# figure "shards" (the sharded allocator over 1-3 replicas, ~2 min) runs when named: --only shards
DEFAULT_FIGURES = ("1", "2", "3", "4", "5", "6", "7", "8", "redis", "hotchunk")


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"must be in [1, 64], not {n}")
    return n


def parse_only(values: list[str] | None) -> list[str]:
    if not values:
        return list(DEFAULT_FIGURES)
    chosen: list[str] = []
    for v in values:
        for f in v.split(","):
            f = f.strip().removeprefix("fig")
            if f not in FIGURES:
                raise ValueError(f"unknown figure {f!r}; choose from {', '.join(FIGURES)}")
            if f not in chosen:
                chosen.append(f)
    return sorted(chosen)


def run_profiles(ctx: Ctx, allocator: bool = False) -> None:
    """Where the Python CPU of a decision (and of a grant) goes, written next to the results."""
    from .profile import profile_allocator, profile_engine, profile_http

    todo = [("profile-engine.txt", profile_engine), ("profile-agent-http.txt", profile_http)]
    if allocator:
        todo.append(("profile-allocator.txt", profile_allocator))
    for name, fn in todo:
        print(f"[bench] profiling: {name} ...", flush=True)
        try:
            (ctx.out / name).write_text(fn(ctx.work, 3.0))
            ctx.note(f"profile written: {name}")
        except Exception as e:  # a profile is an aid; its failure is reported, not fatal
            ctx.note(f"profile {name} failed: {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 trial, shorter loops, smaller sizes (~2 min)")
    ap.add_argument("--only", action="append", metavar="FIGURE", help="figure number(s) 1-8, 'redis', 'hotchunk' or 'shards', repeatable or comma list")
    ap.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    ap.add_argument("--profile", choices=("auto", "yes", "no"), default="auto",
                    help="profile the engine (pyinstrument), an agent and an allocator under load (py-spy); auto: "
                         "full runs where figure 2, 3 or 4 misses its goal")
    ap.add_argument("--workers", type=_workers, default=1,
                    help="uvicorn workers of the agent and the echo app (fig 2), 1-64 (the agent's range)")
    ap.add_argument("--agent-args", default="", metavar="'FLAGS'",
                    help="extra region_agent flags for figures 1, 2 and 5, e.g. '--decision-budget-ms 200'")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' directories and logs")
    a = ap.parse_args(argv)
    # every option checked before anything starts: a usage error is exit 2 with one line
    try:
        figures = parse_only(a.only)
        agent_args = shlex.split(a.agent_args)
    except ValueError as e:  # an unknown figure; --agent-args with an unclosed quote
        ap.error(str(e))
    out: Path = a.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out {out}: {e.strerror}")
    ctx = Ctx.make(out.resolve(), a.quick)
    ctx.workers = a.workers
    ctx.agent_args = agent_args
    shutil.rmtree(ctx.work, ignore_errors=True)
    ctx.work.mkdir(parents=True)

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwind like Ctrl-C: each figure's finally stops its servers by PID

    signal.signal(signal.SIGTERM, _term)
    started = time.time()
    rows: list[Row] = []
    failed = False
    for f in figures:
        for fn in FIGURES[f]:
            t0 = time.monotonic()
            print(f"[bench] figure {f}: {fn.__module__.rsplit('.', 1)[1]}.{fn.__name__} ...", flush=True)
            try:
                got = fn(ctx)
            except Exception as e:  # one broken figure must not hide the others
                failed = True
                ctx.note(f"figure {f} ({fn.__name__}) failed: {type(e).__name__}: {e}")
                traceback.print_exc()
                got = [Row(f, f"{fn.__module__.rsplit('.', 1)[1]} did not complete: {type(e).__name__}",
                           float("nan"), "", extra={"error": str(e)[:2000]})]
                got[0].goal = None
            rows.extend(got)
            print(render_text(got), f"\n[bench] figure {f} took {time.monotonic() - t0:.1f} s", flush=True)
    if a.profile == "yes" or (a.profile == "auto" and not a.quick and any(
            r.figure in ("2", "3", "4") and r.verdict == "FAIL" for r in rows)):
        run_profiles(ctx, allocator=a.profile == "yes" or any(r.figure == "4" and r.verdict == "FAIL" for r in rows))
    try:
        for sentence in explain(rows):
            ctx.note(sentence)
    except Exception as e:  # an explanation must never cost the results
        ctx.note(f"could not explain the bounds: {type(e).__name__}: {e}")
    meta = {"started": started, "agent_args": ctx.agent_args, "workers": ctx.workers, "elapsed_s": time.time() - started, "quick": a.quick, "trials": ctx.trials,
            "figures": figures, "env": environment()}
    write_json(out / "results.json", rows, meta)
    write_markdown(out / "results.md", rows, meta, ctx.notes)
    plotted = plot_fig2(out / "fig2-concurrency.png", ctx.plot_data.get("fig2", {}))
    if not a.keep_logs and not failed:
        shutil.rmtree(ctx.work, ignore_errors=True)
    print("\n" + render_text(rows))
    for n in ctx.notes:
        print(f"note: {n}")
    print(f"\n[bench] wrote {out / 'results.json'}, {out / 'results.md'}"
          + (f", {out / 'fig2-concurrency.png'}" if plotted else "") + f" in {meta['elapsed_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
