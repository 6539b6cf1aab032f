"""The demand-weighted fair share both services use (kernel.fair_share): the allocator's numbers,
and the split of one RLQS round among the Envoys of a bucket, its rounding carried."""

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
    assert split(30, {"a": 10, "b": 20}, {"a": 1, "b": 1}) == ({"a": 10, "b": 20}, {"a": 0.0, "b": 0.0})


def test_split_shares_a_short_round_by_demand() -> None:
    assert split(20, {"a": 20, "b": 20}, {"a": 3, "b": 1})[0] == {"a": 15, "b": 5}
    # b's share (7/3) is above its need: the rest goes to a and c alike; 2.5 each, the odd token to a
    gives, owed = split(7, {"a": 20, "b": 2, "c": 20}, {"a": 1, "b": 1, "c": 1})
    assert gives == {"a": 3, "b": 2, "c": 2} and owed == {"a": -0.5, "b": 0.0, "c": 0.5}
    assert split(7, {"a": 20, "b": 2, "c": 20}, {"a": 1, "b": 1, "c": 1}, owed)[0] == {"a": 2, "b": 2, "c": 3}


def test_a_run_of_one_token_splits_is_shared_by_demand_not_all_to_the_busiest() -> None:
    """A scarce bucket refilling a token at a time: rounded alone, every token went to the party
    with the most demand; with the rounding carried, each gets its share within a token."""
    got, owed = {"a": 0, "b": 0}, None
    for _ in range(50):
        gives, owed = split(1, {"a": 40, "b": 12}, {"a": 8.0, "b": 2.0}, owed)
        got = {k: got[k] + gives[k] for k in got}
    assert abs(got["b"] - 10) <= 1 and got["a"] + got["b"] == 50


@given(st.integers(0, 500),
       st.dictionaries(st.sampled_from("abcdefgh"),
                       st.tuples(st.integers(1, 100), st.floats(0, 1000), st.floats(-1, 1)), min_size=1))
def test_split_never_gives_more_than_it_has_or_anyone_asked(tokens, parties) -> None:
    needs = {k: n for k, (n, _, _) in parties.items()}
    demands = {k: d for k, (_, d, _) in parties.items()}
    owed_before = {k: o for k, (_, _, o) in parties.items()}
    out, owed = split(tokens, needs, demands, owed_before)
    assert set(out) == set(needs) == set(owed)
    assert all(0 <= out[k] <= needs[k] for k in needs)
    assert all(-1.0 <= o <= 1.0 for o in owed.values())
    if sum(needs.values()) <= tokens:
        assert out == needs
    else:  # nothing left idle while someone is short, and never more than there is
        assert sum(out.values()) == tokens
