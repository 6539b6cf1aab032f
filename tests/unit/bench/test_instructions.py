"""bench.instructions in process, without valgrind: the grouped RLS door (``--door rls-group``)
against a real redis-server: every call is decided in a group of ``GROUP`` whatever the timing,
and a pair whose groups were not whole is refused; ``--fresh``: every counted decision asks for a
user never asked before, and each door still admits it from the store."""

from __future__ import annotations

import asyncio

import pytest

from bench.instructions import GROUP, WARMUP, _child, _expected, _refusal, cache_counts, main, user_of


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
    with pytest.raises(SystemExit):
        main(["--door", "rls-group", "--group", "3", "--extra", "8"])
    with pytest.raises(SystemExit):  # a group larger than the tasks that fill it would never be whole
        main(["--door", "rls-group", "--group", str(GROUP + 1), "--extra", str(GROUP + 1)])


def test_a_smaller_group_is_decided_whole(redis_url: str):
    info = asyncio.run(_child(redis_url, "rls-group", 8, 8, group=4))
    assert info["whole"] and info["groups"] == (WARMUP + 8) // 4 and info["kinds"] == [["rls", 1]]


CACHEGRIND = """==7== I   refs:      3,456,532,803
==7== I1  misses:        1,432,360
==7== LLi misses:           69,040
==7== I1  miss rate:          0.04%
==7== LLi miss rate:          0.00%
==7==
==7== D   refs:      1,230,011,222  (800,000,000 rd   + 430,011,222 wr)
==7== D1  misses:       12,999,920  (  9,000,000 rd   +   3,999,920 wr)
==7== LLd misses:        1,730,400  (  1,000,000 rd   +     730,400 wr)
==7== D1  miss rate:           1.1% (        1.1%     +         0.9%  )
==7==
==7== LL refs:          14,432,280  ( 10,432,360 rd   +   3,999,920 wr)
==7== LL misses:         1,799,440  (  1,069,040 rd   +     730,400 wr)
"""


def test_the_cache_simulations_summary_is_read_by_event():
    assert cache_counts(CACHEGRIND) == {"I": 3_456_532_803, "I1": 1_432_360, "LLi": 69_040, "D": 1_230_011_222,
                                        "D1": 12_999_920, "LLd": 1_730_400}
    assert cache_counts("==7== I   refs:      1,000\n") == {"I": 1_000}  # without --cache-sim: instructions only


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
