"""Pure parts of the benchmark: percentiles, medians, goal evaluation and table rendering.

No I/O: the figure runners produce :class:`Row` values, this module judges and renders them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OPS = (">=", "<=")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi:
        return float(s[lo])
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    return percentile(list(values), 50)


@dataclass(frozen=True)
class Goal:
    op: str  # ">=" or "<="
    target: float

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"goal operator must be one of {OPS}, not {self.op!r}")

    def met(self, x: float) -> bool:
        return x >= self.target if self.op == ">=" else x <= self.target

    def __str__(self) -> str:
        return f"{self.op} {self.target:g}"


def ratio(value: float, ceiling: float | None) -> float | None:
    """value / ceiling, or None without a (positive) ceiling."""
    if ceiling is None or ceiling <= 0:
        return None
    return value / ceiling


@dataclass
class Row:
    """One line of the results table.

    ``ratio`` is judged against ``goal`` when both exist; rows without a ceiling judge
    ``judged`` (default: the value itself); rows without a goal are informational."""

    figure: str
    name: str
    value: float
    unit: str
    ceiling: float | None = None
    ceiling_name: str = ""
    goal: Goal | None = None
    judged: float | None = None  # what the goal applies to when there is no ceiling
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return ratio(self.value, self.ceiling)

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "info"
        x = self.ratio if self.ceiling is not None else (self.judged if self.judged is not None else self.value)
        if x is None or math.isnan(x):
            return "FAIL"
        return "pass" if self.goal.met(x) else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["goal"] = str(self.goal) if self.goal else None
        d["ratio"] = self.ratio
        d["verdict"] = self.verdict
        return d


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


HEADERS = ("figure", "measure", "value", "ceiling", "ratio", "goal", "result")


def cells(row: Row) -> tuple[str, ...]:
    ceiling = f"{fmt(row.ceiling)} ({row.ceiling_name})" if row.ceiling is not None else "-"
    return (row.figure, row.name, f"{fmt(row.value)} {row.unit}".strip(), ceiling, fmt(row.ratio),
            str(row.goal) if row.goal else "-", row.verdict)


def render_text(rows: Sequence[Row]) -> str:
    table = [HEADERS, *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS))]
    out = []
    for n, line in enumerate(table):
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def render_markdown(rows: Sequence[Row]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    out = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(esc(c) for c in cells(r)) + " |" for r in rows]
    return "\n".join(out)
