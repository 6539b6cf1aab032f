"""The one private part of prometheus_client the agent touches: a histogram child's bucket and sum
values (``_buckets``, ``_sum``, each with ``inc``), so the observations counted in plain Python
between two collections (region_agent.decision.telemetry) enter the registry as one increment per bucket
instead of one ``observe`` per decision. Nothing else in the project reads a private name of
prometheus_client.

Checked when this module is imported: a release that renames one stops the agent at start with
:class:`PrometheusInternalsChanged` naming it. The cap on ``prometheus-client`` in pyproject.toml
names the release line this was checked with; tests/unit/region_agent/service/test_prometheus_internals.py fails
when one disappears, and tests/unit/region_agent/decision/test_telemetry.py compares the exposition with
``observe``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import values as prometheus_values


class PrometheusInternalsChanged(RuntimeError):
    """A private part of prometheus_client this module relies on is gone or renamed."""


def missing(histogram_cls: Any = Histogram) -> list[str]:
    """The private parts the installed prometheus_client lacks (empty: all there). The check's
    histogram keeps its values in memory: with several workers a value is otherwise a file entry,
    and every scrape showed ``leasehold_internals_check``."""
    file_backed, prometheus_values.ValueClass = prometheus_values.ValueClass, prometheus_values.MutexValue
    try:
        child = histogram_cls("leasehold_internals_check", "-", ["l"], registry=CollectorRegistry()).labels("x")
    finally:
        prometheus_values.ValueClass = file_backed
    gone = [f"Histogram child .{name}" for name in ("_sum", "_buckets") if not hasattr(child, name)]
    if not gone:
        values = [child._sum, *child._buckets]
        if not all(callable(getattr(v, "inc", None)) for v in values):
            gone.append("Histogram child ._sum / ._buckets values with .inc")
    return gone


_gone = missing()
if _gone:
    raise PrometheusInternalsChanged(f"prometheus_client: missing {', '.join(_gone)} "
                                     "(region_agent/service/prometheus_internals.py)")


def add_observations(child: Any, total: float, bucket_counts: Sequence[int]) -> None:
    """Add observations to a histogram child at once: ``bucket_counts[i]`` of them fell in bucket
    ``i`` (not cumulative: what ``observe`` increments), their values summing to ``total``."""
    child._sum.inc(total)
    for value, n in zip(child._buckets, bucket_counts, strict=True):
        if n:
            value.inc(n)
