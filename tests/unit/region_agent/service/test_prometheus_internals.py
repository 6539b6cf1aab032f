"""The private parts of prometheus_client that region_agent.service.prometheus_internals uses are there,
the check names one that is not, and adding observations at once equals observing them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from region_agent.service import prometheus_internals as pi


def test_every_private_part_is_there() -> None:
    assert pi.missing() == []


class _Child:
    pass


class _HistogramWithoutInternals:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def labels(self, *values: str) -> _Child:
        return _Child()


def test_a_missing_part_is_named() -> None:
    assert pi.missing(_HistogramWithoutInternals) == ["Histogram child ._sum", "Histogram child ._buckets"]


def test_adding_at_once_equals_observing_one_by_one() -> None:
    observed = [0.0004, 0.002, 0.002, 0.03, 7.0]
    by_hand, at_once = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "-", ["l"], buckets=(0.001, 0.01, 0.1), registry=by_hand).labels("x")
    b = Histogram("h", "-", ["l"], buckets=(0.001, 0.01, 0.1), registry=at_once).labels("x")
    for v in observed:
        a.observe(v)
    pi.add_observations(b, sum(observed), [1, 2, 1, 1])  # per bucket, +Inf last
    assert generate_latest(by_hand) == generate_latest(at_once)
