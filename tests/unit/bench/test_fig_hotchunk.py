"""Figure hotchunk's bundles: valid, the same limits with and without hotChunk, and its bound term."""

from __future__ import annotations

from bench.__main__ import DEFAULT_FIGURES, FIGURES
from bench.fig_hotchunk import HOT, bench_bundle, script_budget_per_s
from kernel.bound import Topology, hot_chunk_term


def test_the_bundles_differ_only_by_hot_chunk():
    plain, chunked = bench_bundle(None), bench_bundle(HOT)
    assert [r.id for r in plain.rules] == [r.id for r in chunked.rules]
    assert all(r.hot_chunk is None for r in plain.rules) and all(r.hot_chunk == HOT for r in chunked.rules)
    assert hot_chunk_term(chunked.rules[0], Topology.uniform(1, 1)).tokens == HOT.chunk_max


def test_the_figure_is_registered_and_runs_by_default():
    assert "hotchunk" in FIGURES and "hotchunk" in DEFAULT_FIGURES


def test_the_script_budget_comes_from_the_recorded_measurement():
    budget = script_budget_per_s()
    assert budget is not None and 1_000 < budget < 1_000_000
