"""kernel.caches: the stated bounds hold, and what each cache keeps."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel.caches import LRU, BoundedMemo


@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=200))
def test_memo_never_holds_more_than_its_bound(bound: int, keys: list[int]) -> None:
    memo: BoundedMemo[int, int] = BoundedMemo(bound)
    for k in keys:
        assert memo.get_or_put(k, lambda k=k: k * 2) == k * 2
        assert len(memo) <= bound and memo[k] == k * 2


def test_memo_empties_when_a_new_key_comes_to_a_full_memo_but_not_for_a_known_key() -> None:
    memo: BoundedMemo[str, int] = BoundedMemo(2)
    memo.put("a", 1)
    memo.put("b", 2)
    memo.put("b", 3)  # known key: overwritten in place
    assert dict(memo) == {"a": 1, "b": 3}
    memo.put("c", 4)
    assert dict(memo) == {"c": 4}


@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=200))
def test_lru_keeps_exactly_the_last_written_keys(bound: int, keys: list[int]) -> None:
    lru: LRU[int, int] = LRU(bound)
    for k in keys:
        lru.put(k, k)
    newest: list[int] = []
    for k in reversed(keys):
        if k not in newest:
            newest.append(k)
    assert sorted(k for k, _ in lru.items()) == sorted(newest[:bound])


def test_lru_reads_do_not_reorder_and_pop_removes() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1
    lru.put("c", 3)  # "a" was written first: evicted although it was read last
    assert "a" not in lru and lru.get("b") == 2 and len(lru) == 2
    assert lru.pop("b") == 2 and lru.pop("b") is None and len(lru) == 1


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        BoundedMemo(0)
    with pytest.raises(ValueError):
        LRU(0)
