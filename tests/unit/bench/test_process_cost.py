"""bench.process_cost's arithmetic and arguments: per call is the difference of two runs' counts
over the difference of their calls (start-up and imports cancel out), with the L2 misses per 1,000
instructions; the runs' counts must grow with the calls."""

from __future__ import annotations

import pytest

from bench.process_cost import main, per_call


def test_per_call_is_the_difference_of_two_runs():
    small = {"I": 1_000_000, "LLi": 1_000, "LLd": 2_000, "D1": 500}
    large = {"I": 3_000_000, "LLi": 3_000, "LLd": 6_000, "D1": 1_500, "D": 9}  # D: counted in one run only
    got = per_call(small, large, 1_000, 3_000)
    assert got == {"I": 1_000.0, "LLi": 1.0, "LLd": 2.0, "D1": 0.5, "LL_per_1000": 3.0}


def test_per_call_needs_more_calls_in_the_large_run():
    with pytest.raises(ValueError):
        per_call({"I": 1}, {"I": 2}, 3_000, 1_000)


@pytest.mark.parametrize("calls", ["3000,1000", "1000", "0,10", "a,b"])
def test_bad_counts_of_calls_are_refused_before_anything_starts(calls: str):
    with pytest.raises(SystemExit) as e:
        main(["--calls", calls])
    assert e.value.code == 2
