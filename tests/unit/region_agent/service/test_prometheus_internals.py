"""The private parts of prometheus_client that region_agent.service.prometheus_internals uses are there,
the check names one that is not, and adding observations at once equals observing them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from region_agent.service import prometheus_internals as pi
from region_agent.service.metrics import BATCH_SIZE_BUCKETS, AgentMetrics

# (importing region_agent.service.metrics turns the *_created series off, as in the agent: with them,
# two registries' expositions differ by their creation times when this file runs alone)


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


def test_pipeline_sizes_counted_until_collection_read_as_one_observe_each() -> None:
    """The store nodes count each pipeline's size in plain Python (AgentMetrics.batch_sizes) and
    the registry takes them at the next collection: every scrape reads what one ``observe`` per
    pipeline would have made, bounds included (a size equal to a bucket's bound is in it)."""
    sizes = [1, 1, 2, 3, 4, 5, 32, 33, 1024, 1025, 7]
    by_hand = CollectorRegistry()
    reference = Histogram("leasehold_agent_batch_size", "Script calls per coalesced pipeline", registry=by_hand,
                          buckets=BATCH_SIZE_BUCKETS)
    m = AgentMetrics()

    def exposed(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines()
                if line.startswith("leasehold_agent_batch_size")]

    for first, rest in ((sizes[:4], sizes[4:]), ([], [])):
        for s in first + rest:
            reference.observe(s)
            m.batch_sizes.observe(s)
        assert exposed(m.registry) == exposed(by_hand)  # twice: a collection takes the counts once
