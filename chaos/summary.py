"""``python -m chaos summary REPORT_DIR`` — one Markdown table over a directory of chaos reports:
scenario x seed -> per pool the worst window's overshoot beyond G against what the bound allowed
there, the utilisation of windows whose demand exceeded G (all of them, and the lowest of those no
fault touched: the ones judged against the floor), and the verdict.

``--readme chaos/README.md`` writes the table between the README's
``<!-- generated:chaos-summary -->`` markers instead of printing it. For several reports of one
(scenario, seed) the latest counts. Pure apart from reading ``report.json`` files.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from pathlib import Path

_DIR = re.compile(r"^(?P<scenario>.+)-seed(?P<seed>\d+)-(?P<time>\d{8}T\d{6})$")


def load_reports(root: Path) -> list[dict]:
    """The latest report.json per (scenario, seed) under ``root`` (one level deep)."""
    latest: dict[tuple[str, int], tuple[str, dict]] = {}
    for path in sorted(root.glob("*/report.json")):
        m = _DIR.match(path.parent.name)
        if not m:
            continue
        doc = json.loads(path.read_text())
        key = (doc.get("scenario", m["scenario"]), int(doc.get("seed", m["seed"])))
        if key not in latest or latest[key][0] < m["time"]:
            latest[key] = (m["time"], doc | {"dir": path.parent.name})
    return [doc for _key, (_t, doc) in sorted(latest.items())]


def _pool_cell(w: dict | None) -> str:
    if not w:
        return "–"
    over = w["admitted"] - w["limit"]
    allowed = w["bound"] - w["limit"]
    mark = " **over**" if w["admitted"] > w["bound"] else ""
    return f"{over:+d} / {allowed:+d}{mark}"


def _util(rows: Iterable[dict]) -> str:
    ratios = [u["ratio"] for u in rows]
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def _fault_free(rows: Iterable[dict]) -> str:
    """Over the judged windows (fault-free, demand > G): the lowest utilisation as attributed, the
    lowest counting the answers that may lie in a neighbouring window (what is judged), and how many."""
    judged = [u for u in rows if u.get("judged")]
    if not judged:
        return "–"
    low = min(u["ratio"] for u in judged)
    most = min(u.get("ratioMax", u["ratio"]) for u in judged)
    return f"{low:.2f} / {most:.2f} ({len(judged)})"


def _verdict(doc: dict) -> str:
    if doc.get("ok"):
        return "PASS"
    failed = [v["invariant"] for v in doc.get("verdicts", []) if not v.get("ok")]
    unmet = doc.get("unmetExpectations") or []
    return "FAIL: " + ", ".join(failed + [f"expectation: {u}" for u in unmet])


def table(docs: list[dict]) -> str:
    pools = sorted({p for d in docs for p in d.get("worst", {})})
    head = ["scenario", "seed", *[f"`{p}` worst: overshoot / allowed" for p in pools],
            "utilisation (demand > G): median (range)", "fault-free windows (demand > G): lowest / at most (windows)", "verdict"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in docs:
        row = [f"`{d['scenario']}`", str(d["seed"]), *[_pool_cell(d.get("worst", {}).get(p)) for p in pools],
               _util(d.get("utilisation", [])), _fault_free(d.get("utilisation", [])), _verdict(d)]
        out.append("| " + " | ".join(row) + " |")
    runs, passed = len(docs), sum(1 for d in docs if d.get("ok"))
    out.append("")
    out.append(f"{passed} of {runs} runs passed. *overshoot / allowed*: the worst window's admitted - G, "
               "against bound - G in that window (what its faults allowed); utilisation: admitted / G; "
               "fault-free windows: those no fault, policy change or edge of the load touched, judged against "
               "0.97 at their most (counting the answers received after a boundary their request was sent "
               "before in both windows).")
    return "\n".join(out)


def write_readme(readme: Path, text: str, name: str = "chaos-summary") -> None:
    body = readme.read_text()
    pattern = re.compile(rf"(<!-- generated:{name} -->\n)(.*?)(<!-- /generated:{name} -->)", re.DOTALL)
    if not pattern.search(body):
        raise ValueError(f"{readme} has no <!-- generated:{name} --> block")
    readme.write_text(pattern.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(3), body, count=1))
