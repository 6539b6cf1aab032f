"""Check the Grafana dashboard and the Prometheus alert rules against the metric table
(``docs/metrics.md``, i.e. :func:`devtools.metrics_doc.all_rows`): every metric a query names
exists, and every label it filters, groups or prints by exists on the metrics of that query.

A small PromQL reader, enough for the expressions in ``deploy/`` (selectors with matchers,
``by``/``without``/``on``/``ignoring``/``group_left``/``group_right`` lists, legend
``{{label}}`` and annotation ``{{ $labels.label }}`` references). Used by
``tests/unit/test_deploy_queries.py`` (names and labels) and ``tests/e2e/test_deploy_files.py``
(every panel is backed by series on a live ``leasehold up`` topology).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from .metrics_doc import MetricRow, all_rows

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
METRIC_RE = re.compile(r"\b(leasehold_[a-z0-9_]+)\b(\{[^}]*\})?")
MATCHER_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)")
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
TEMPLATE_RE = re.compile(r"\{\{\s*(?:\$labels\.)?([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
# labels Prometheus adds to every scraped series (deploy/prometheus/prometheus.yml)
TARGET_LABELS = frozenset({"instance", "job", "region"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Query:
    where: str  # "dashboard panel 'title'" or "alert NAME"
    expr: str
    templates: tuple[str, ...] = ()  # legendFormat / annotations that reference labels


def dashboard_queries(path: Path | None = None) -> list[tuple[str, list[Query]]]:
    """(panel title, its queries) for every panel of the dashboard."""
    d = json.loads((path or DEPLOY / "grafana" / "leasehold-dashboard.json").read_text())
    out = []
    for p in d["panels"]:
        qs = [Query(f"dashboard panel {p['title']!r}", t["expr"], (t.get("legendFormat", ""),))
              for t in p.get("targets", [])]
        out.append((p["title"], qs))
    return out


def alert_queries(path: Path | None = None) -> list[Query]:
    import yaml  # a test/tooling dependency, not one of the services'

    doc = yaml.safe_load((path or DEPLOY / "prometheus" / "alerts.yml").read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            notes = tuple(str(v) for v in (rule.get("annotations") or {}).values())
            out.append(Query(f"alert {rule['alert']}", rule["expr"], notes))
    return out


def _resolve(name: str, table: dict[str, MetricRow]) -> tuple[MetricRow | None, bool]:
    """(row, is_bucket) for a name as written in PromQL."""
    if name in table:
        return table[name], False
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in table and table[base].type == "histogram":
            return table[base], suffix == "_bucket"
    return None, False


def metric_names(expr: str) -> set[str]:
    return {m.group(1) for m in METRIC_RE.finditer(expr)}


def problems(q: Query, table: dict[str, MetricRow]) -> list[str]:
    out: list[str] = []
    available = set(TARGET_LABELS)
    for m in METRIC_RE.finditer(q.expr):
        row, bucket = _resolve(m.group(1), table)
        if row is None:
            out.append(f"{q.where}: metric {m.group(1)} is not in the metric table")
            continue
        own = set(row.labels) | TARGET_LABELS | ({"le"} if bucket else set())
        available |= own
        for label, _op in MATCHER_RE.findall(m.group(2) or ""):
            if label not in own:
                out.append(f"{q.where}: {m.group(1)} has no label {label!r} (labels: {sorted(row.labels)})")
    for _kw, names in GROUPING_RE.findall(q.expr):
        for label in (x.strip() for x in names.split(",")):
            if label and label not in available:
                out.append(f"{q.where}: groups by {label!r}, which none of its metrics carries")
    for text in q.templates:
        for label in TEMPLATE_RE.findall(text):
            if label not in available:
                out.append(f"{q.where}: template names label {label!r}, which none of its metrics carries")
    return out


def check_all() -> list[str]:
    table = {r.name: r for r in all_rows()}
    out: list[str] = []
    for _title, qs in dashboard_queries():
        for q in qs:
            out += problems(q, table)
    for q in alert_queries():
        out += problems(q, table)
    return out
