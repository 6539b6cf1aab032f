"""The policy-follower metrics both services export, defined once (names: docs/metrics.md):
``leasehold_<service>_policy_reloads_total{outcome}``, ``..._policy_version`` and
``..._policy_age_seconds``."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from .metrics_exposition import FunctionGauge

# every outcome of offering a bundle to a service (each series exists from the start, at 0)
RELOAD_OUTCOMES = ("accepted", "stale", "invalid", "unsigned", "untrusted_key", "bad_signature")


def policy_metrics(service: str, registry: CollectorRegistry, *, offered: str, age: str) -> tuple[Counter, Gauge, Any]:
    """``(reloads, version, age)`` for ``service`` (``agent`` / ``allocator``); ``offered`` says where
    bundles come from, ``age`` what the age gauge measures."""
    reloads = Counter(f"leasehold_{service}_policy_reloads_total",
                      f"Policy bundles offered ({offered}), by outcome ({', '.join(RELOAD_OUTCOMES)})",
                      ["outcome"], registry=registry)
    for outcome in RELOAD_OUTCOMES:
        reloads.labels(outcome)
    # with several agent workers: the oldest version any live worker holds
    version = Gauge(f"leasehold_{service}_policy_version", "Bundle version in force", registry=registry,
                    multiprocess_mode="livemin")
    age_gauge = FunctionGauge(f"leasehold_{service}_policy_age_seconds", age, registry=registry)
    return reloads, version, age_gauge


__all__ = ["RELOAD_OUTCOMES", "policy_metrics"]
