"""Every query of the Grafana dashboard is drawn in the unit of what it computes: a panel's
default unit holds for its queries unless a field override for the query's refId (matcher
``byFrameRefID``) gives another. A p99 in seconds on a requests-per-second axis, or a share of
decisions drawn as req/s, reads wrong at 3 am: 0.004 "req/s" is a 4 ms latency.

What a query computes is read from its expression: a quantile of a ``*_seconds`` histogram, a
``*_seconds`` gauge or the mean of a seconds counter is seconds; a ``*_bytes`` gauge bytes; one
metric's rate divided by the same metric's rate (a share) a ratio; CPU seconds per second a
ratio of a core; any other rate a per-second unit; an increase a count."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "leasehold-dashboard.json"

PER_SECOND = {"reqps", "ops", "cps", "short"}
COUNT = {"short", "none"}
SECONDS = {"s"}
BYTES = {"bytes", "decbytes"}
RATIO = {"percentunit"}
METRIC = r"[a-z_:][a-z0-9_:]*"
RATE_OF = re.compile(rf"\b(rate|increase)\(({METRIC})")


def expected_units(expr: str) -> set[str]:
    e = " ".join(expr.split())
    quantile = re.search(rf"histogram_quantile\([^,]+,.*?\b({METRIC})_bucket\b", e)
    if quantile:
        return SECONDS if quantile.group(1).endswith("_seconds") else COUNT
    rates = RATE_OF.findall(e)
    if "/" in e and len(rates) >= 2:
        num, den = rates[0][1], rates[-1][1]
        if num == den:
            return RATIO  # a share of one counter's events
        if num.endswith("_seconds_total"):
            return SECONDS  # seconds spent per call: a mean duration
    if rates and rates[0][1] == "process_cpu_seconds_total":
        return RATIO | {"short"}  # cores busy
    if rates:
        return PER_SECOND if rates[0][0] == "rate" else COUNT
    names = re.findall(rf"\b({METRIC})\b", e)
    if any(n.endswith("_bytes") for n in names):
        return BYTES
    if any(n.endswith("_seconds") for n in names):
        return SECONDS
    if any(n.endswith("_ratio") for n in names):
        return RATIO
    return COUNT


def effective_units() -> list[tuple[str, str, str, str]]:
    """(panel title, refId, expression, unit drawn) for every query of the dashboard."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        config = panel.get("fieldConfig", {})
        default = config.get("defaults", {}).get("unit", "")
        by_ref: dict[str, str] = {}
        for override in config.get("overrides", []):
            matcher = override.get("matcher", {})
            if matcher.get("id") != "byFrameRefID":
                continue
            for prop in override.get("properties", []):
                if prop.get("id") == "unit":
                    by_ref[matcher.get("options")] = prop["value"]
        for target in panel.get("targets", []):
            out.append((panel["title"], target["refId"], target["expr"], by_ref.get(target["refId"], default)))
    return out


def test_every_query_is_drawn_in_the_unit_of_what_it_computes():
    wrong = [f"{title!r} {ref}: drawn as {unit!r}, computes {sorted(expected_units(expr))}: {expr}"
             for title, ref, expr, unit in effective_units() if unit not in expected_units(expr)]
    assert not wrong, "\n".join(wrong)


def test_the_reader_tells_the_kinds_apart():
    assert expected_units("histogram_quantile(0.99, sum by (le) (rate(leasehold_agent_rls_seconds_bucket[1m])))") == SECONDS
    assert expected_units("histogram_quantile(0.5, sum by (le) (rate(leasehold_agent_batch_size_bucket[1m])))") == COUNT
    assert expected_units("sum(rate(x_total{a=\"b\"}[5m])) / sum(rate(x_total[5m]))") == RATIO
    assert expected_units("sum(rate(x_seconds_total[1m])) / sum(rate(x_calls_total[1m]))") == SECONDS
    assert expected_units("sum by (pool) (rate(x_total[1m]))") == PER_SECOND
    assert expected_units("sum by (rule) (increase(x_total[10m]))") == COUNT
    assert expected_units("max by (shard) (x_memory_used_bytes)") == BYTES
    assert expected_units("max by (instance) (x_policy_age_seconds)") == SECONDS
