"""The demand-weighted fair share both services use (kernel.fair_share): the allocator's numbers,
and the split of one RLQS round among the Envoys of a bucket."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kernel.fair_share import fair_share, is_low, split


def test_not_low_means_no_cap() -> None:
    assert not is_low(200, 100, 2) and fair_share(200, 100, {"eu": 5, "us": 1}, "eu") is None
    assert is_low(199, 100, 2)


def test_share_is_weighted_by_demand_and_at_least_one() -> None:
    demands = {"eu": 90, "us": 10}
    assert fair_share(100, 100, demands, "eu") == 90 and fair_share(100, 100, demands, "us") == 10
    assert fair_share(3, 100, {"eu": 1000, "us": 1}, "us") == 1  # 1 at least while anything remains
    assert fair_share(0, 100, demands, "eu") == 0
    assert fair_share(50, 100, {"eu": 0, "us": 0}, "us") == 25  # no demand signal: weight 1 each
    assert fair_share(50, 100, {"eu": 3}, "new") == 16  # a party not listed weighs 1 (the total: the listed)


def test_split_gives_every_need_when_it_fits() -> None:
    assert split(30, 20, {"a": 10, "b": 20}, {"a": 1, "b": 1}) == {"a": 10, "b": 20}


def test_split_shares_a_short_round_by_demand() -> None:
    out = split(20, 20, {"a": 20, "b": 20}, {"a": 3, "b": 1})
    assert out == {"a": 15, "b": 5}
    out = split(7, 20, {"a": 20, "b": 2, "c": 20}, {"a": 1, "b": 1, "c": 1})
    assert sum(out.values()) == 7 and out["b"] <= 2


@given(st.integers(0, 500), st.integers(1, 100),
       st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(st.integers(1, 100), st.integers(0, 1000)),
                       min_size=1))
def test_split_never_gives_more_than_it_has_or_anyone_asked(remaining, cap, parties) -> None:
    needs = {k: min(cap, n) for k, (n, _) in parties.items()}
    demands = {k: d for k, (_, d) in parties.items()}
    out = split(remaining, cap, needs, demands)
    assert set(out) == set(needs)
    assert sum(out.values()) <= remaining
    assert all(0 <= out[k] <= needs[k] for k in needs)
    if sum(needs.values()) <= remaining:
        assert out == needs
    else:  # nothing left idle while someone is short
        assert sum(out.values()) == min(remaining, sum(needs.values()))
