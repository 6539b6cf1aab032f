"""A chaos run's report directory:

* ``report.json`` — verdict per invariant (with violations), per-pool worst window (admitted,
  G, bound, overshoot), utilisation per window with demand above G (``touched``: what touched it,
  ``judged``: held to the fault-free floor), faults with times (relative to the run start and
  absolute), scenario expectations, load statistics;
* ``report.txt`` — the same as text (``Report.render()`` plus expectations);
* ``<pool>.png`` — admitted per window against G and the bound, fault intervals shaded
  (matplotlib, Agg backend);
* ``history.jsonl`` — the run's history (replay with ``python -m chaos check``).

Plot data are built by the pure :func:`pool_series`; only :func:`plot_pool` touches matplotlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from chaos.invariants import WindowBound

from .history import Fault, Meta, read_history

if TYPE_CHECKING:
    from .run import RunResult


@dataclass
class PoolSeries:
    pool: str
    window_ms: int
    starts_s: list[float]  # window start relative to the run start
    admitted: list[int]
    limit: list[int]
    bound: list[int]


def pool_series(windows: Sequence[WindowBound], window_ms: dict[str, int], t0_ms: int) -> dict[str, PoolSeries]:
    out: dict[str, PoolSeries] = {}
    for w in sorted(windows, key=lambda w: (w.pool, w.window_index)):
        wm = window_ms.get(w.pool)
        if wm is None:
            continue
        s = out.setdefault(w.pool, PoolSeries(w.pool, wm, [], [], [], []))
        s.starts_s.append((w.window_index * wm - t0_ms) / 1000.0)
        s.admitted.append(w.admitted)
        s.limit.append(w.limit)
        s.bound.append(w.bound)
    return out


def fault_spans(faults: Sequence[Fault], t0_ms: int, end_ms: int) -> list[tuple[float, float, str]]:
    return [((f.start_ms - t0_ms) / 1000.0, ((f.stop_ms or end_ms) - t0_ms) / 1000.0, f"{f.nemesis}:{f.target}")
            for f in faults]


def plot_pool(series: PoolSeries, spans: Sequence[tuple[float, float, str]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    width = series.window_ms / 1000.0
    ax.bar(series.starts_s, series.admitted, width=width * 0.9, align="edge", color="#4a7fb5", label="admitted",
           zorder=2)
    ax.step(series.starts_s + [series.starts_s[-1] + width], series.limit + [series.limit[-1]], where="post",
            color="black", label="G (policy in force)")
    ax.step(series.starts_s + [series.starts_s[-1] + width], series.bound + [series.bound[-1]], where="post",
            color="#c0392b", linestyle="--", label="bound (G + fallback + local)")
    top = max(series.bound + series.admitted + [1]) * 1.3
    ax.set_ylim(0, top)
    for i, (a, b, label) in enumerate(spans):
        ax.axvspan(a, max(b, a + 0.1), color="#f5b041", alpha=0.35, label="fault" if i == 0 else None, zorder=1)
        ax.text(a, top * (0.96 - 0.06 * (i % 4)), label, fontsize=7, zorder=3)
    ax.set_xlabel("seconds since run start (window start)")
    ax.set_ylabel("tokens per window")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(result: RunResult) -> Path:
    out = result.out_dir
    out.mkdir(parents=True, exist_ok=True)
    recs = list(read_history(out / "history.jsonl"))
    meta = next((r for r in recs if isinstance(r, Meta)), None)
    t0 = meta.started_at_ms if meta else 0
    end = max((getattr(r, "recorded_at_ms", 0) or 0 for r in recs), default=t0)
    rep = result.report
    faults = [{"nemesis": f.nemesis, "target": f.target, "detail": f.detail, "startS": round((f.start_ms - t0) / 1e3, 2),
               "stopS": None if f.stop_ms is None else round((f.stop_ms - t0) / 1e3, 2), "startMs": f.start_ms,
               "stopMs": f.stop_ms} for f in rep.faults]
    doc = {
        "scenario": result.name, "seed": result.seed, "durationS": result.duration_s, "ok": result.ok,
        "checkerOk": rep.ok, "unmetExpectations": result.unmet, "faults": faults,
        "verdicts": [{"invariant": v.invariant, "ok": v.ok, "checked": v.checked, "note": v.note,
                      "violations": [msgspec.to_builtins(x) for x in v.violations[:50]],
                      "violationCount": len(v.violations)} for v in rep.verdicts],
        "worst": {p: {"window": w.window_index, "admitted": w.admitted, "limit": w.limit, "bound": w.bound,
                      "overshoot": w.overshoot, "excess": w.excess, "fallbackAllowance": w.fallback_allowance,
                      "localAllowance": w.local_allowance} for p, w in rep.worst.items()},
        "utilisation": [{"pool": u.pool, "window": u.window_index, "admitted": u.admitted, "demand": u.demand,
                         "limit": u.limit, "ratio": round(u.ratio, 3), "admittedMax": u.most,
                         "ratioMax": round(u.ratio_max, 3), "touched": u.touched, "judged": u.judged}
                        for u in rep.utilisation],
        "counts": rep.counts, "toleranceMs": rep.tolerance_ms, "stats": result.stats,
    }
    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2))
    text = [f"scenario {result.name} seed {result.seed} ({result.duration_s:.0f} s): {'PASS' if result.ok else 'FAIL'}",
            rep.render()]
    text += [f"  [FAIL] expectation: {u}" for u in result.unmet]
    text += [f"  fault {f['nemesis']} on {f['target']}: {f['startS']} s -> {f['stopS']} s {f['detail']}".rstrip()
             for f in faults]
    (out / "report.txt").write_text("\n".join(text) + "\n")
    window_ms = {}
    for r in recs:
        for p in getattr(r, "pools", []) or []:
            window_ms[p.id] = p.window_ms
    spans = fault_spans(rep.faults, t0, end)
    for pool, s in pool_series(rep.windows, window_ms, t0).items():
        if s.starts_s:
            plot_pool(s, spans, out / f"{pool}.png", f"{result.name} seed {result.seed}: {pool}")
    return out
