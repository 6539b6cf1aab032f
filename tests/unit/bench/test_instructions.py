"""bench.instructions in process, without valgrind: the grouped RLS door (``--door rls-group``)
against a real redis-server: every call is decided in a group of ``GROUP`` whatever the timing,
and a pair whose groups were not whole is refused; ``--fresh``: every counted decision asks for a
user never asked before, and each door still admits it from the store."""

from __future__ import annotations

import asyncio

import pytest

from bench.instructions import GROUP, WARMUP, _child, _expected, _refusal, main, user_of


def test_the_grouped_door_decides_every_call_in_a_whole_group(redis_url: str):
    extra = 8 * GROUP
    info = asyncio.run(_child(redis_url, "rls-group", extra, extra))
    assert info["kinds"] == [["rls", 1]]  # OK answers, every one a store admission
    assert info["decisions"] == WARMUP + extra
    assert info["whole"] and info["grouped"] == WARMUP + extra
    assert info["groups"] == (WARMUP + extra) // GROUP
    assert info["calls"] == WARMUP + extra  # every call's question went to the store, in the groups' pipelines
    assert info["pipelines"] <= info["groups"]


def test_the_single_call_door_makes_no_groups(redis_url: str):
    info = asyncio.run(_child(redis_url, "rls", GROUP, GROUP))
    assert info["groups"] == 0 and info["kinds"] == [["rls", 1]]


def test_a_pair_with_a_group_not_whole_is_refused():
    whole = {"kinds": [["rls", 1]], "whole": True, "grouped": 4_000}
    more = dict(whole, grouped=4_000 + 16)
    assert _refusal("rls-group", whole, more, 16) == ""
    assert "group" in _refusal("rls-group", whole, dict(more, whole=False), 16)
    assert "group" in _refusal("rls-group", whole, dict(more, grouped=4_000 + 8), 16)
    assert "store admission" in _refusal("rls-group", whole, dict(more, kinds=[["rls", 2]]), 16)
    assert _refusal("rls", {"kinds": []}, {"kinds": [["rls", 1]]}, 16) == ""


def test_the_grouped_door_counts_whole_groups_only():
    with pytest.raises(SystemExit):
        main(["--door", "rls-group", "--extra", str(GROUP + 1)])


def test_fresh_counted_decisions_ask_users_never_asked_before():
    warm = {user_of(i, True) for i in range(WARMUP)}
    counted = [user_of(WARMUP + i, True) for i in range(WARMUP)]
    assert warm == set(range(WARMUP // 2)) and len(set(counted)) == len(counted)
    assert not warm & set(counted)
    assert [user_of(i, False) for i in range(WARMUP, WARMUP + 3)] == [0, 1, 2]  # without it: asked again


@pytest.mark.parametrize("door", ["rls", "engine", "http"])
def test_the_fresh_doors_admit_every_first_ask(redis_url: str, door: str):
    info = asyncio.run(_child(redis_url, door, GROUP, GROUP, fresh=True))
    assert info["kinds"] == _expected(door) and info["decisions"] == WARMUP + GROUP
    assert info["calls"] == WARMUP + GROUP  # every first ask went to the store
