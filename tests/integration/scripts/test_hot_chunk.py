"""``lua/hot_chunk.lua`` against its model (kernel.algorithms.hot_chunk), on a real standalone
redis-server and a real Redis Cluster: mixed rule sets, chunks of every size up to the bucket's
tail (a partial chunk), denials with the multi-rule reply, and the validity each kind bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel.algorithms import hot_chunk
from kernel.algorithms.common import InvalidArguments
from kernel.algorithms.multi_rule import RuleSpec

from .support import (
    SETTINGS,
    SLACK,
    as_ints,
    deposit_grants,
    evalsha,
    make_rule,
    read_rules,
    shift_rules,
    step,
    tag,
)

pytestmark = pytest.mark.integration


def unit_rule(kind: str, cost: int) -> RuleSpec:
    """One unit's slot (a chunk of k units charges cost x k): room for chunks of every size."""
    return make_rule(kind, cost, tokens_ms=20_000, count=25, log=25)


def argv(rules: list[RuleSpec], member: str, lo: int, want: int) -> list:
    return [SLACK, member, lo, want] + [x for r in rules for x in (r.kind, *r.params)]


@SETTINGS
@given(kinds=st.lists(st.sampled_from(["tb", "gcra", "fw", "sc", "sl", "pool"]), min_size=1, max_size=4, unique=True),
       grants=st.lists(st.tuples(st.integers(0, 30), st.integers(-500, 0), st.integers(2_000, 9_000)), max_size=2),
       ops=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 1_500]), st.integers(1, 2), st.integers(1, 3),
                              st.integers(0, 30)), min_size=1, max_size=8))
def test_hot_chunk_matches_model(sclient, kinds, grants, ops):
    t = tag()
    keys = [f"rl:{t}:r{i}:{k}" for i, k in enumerate(kinds)]
    states: list = [None] * len(kinds)
    if "pool" in kinds:
        j = kinds.index("pool")
        states[j] = deposit_grants(sclient, keys[j], grants)
    for i, (d, cost, lo, extra) in enumerate(ops):
        states = shift_rules(sclient, kinds, keys, states, d)
        member = f"C{i}"
        rules = [unit_rule(k, cost) for k in kinds]
        want = lo + extra

        def model(n, s=states, rules=rules, member=member, lo=lo, want=want):
            return hot_chunk.take(s, rules, n, member, lo, want)

        def call(rules=rules, member=member, lo=lo, want=want):
            return hot_chunk.reply_of(evalsha(sclient, "hot_chunk", keys, argv(rules, member, lo, want)))

        _, states = step(call, model, lambda: read_rules(sclient, kinds, keys),
                         states, kinds, reply_of=lambda r: r)
        for k, key in zip(kinds, keys, strict=True):
            assert sclient.pttl(key) != -1, k  # every write sets an expiry


def test_tail_of_a_bucket_is_a_partial_chunk(sclient):
    key = f"rl:{tag()}:fw"
    rules = [RuleSpec("fw", (10, 60_000, 1, 0, 0))]
    first = as_ints(evalsha(sclient, "hot_chunk", [key], argv(rules, "C1", 1, 7)))
    assert first[0] == 7 and first[2:] == [1, 0, 0, 3]
    tail = as_ints(evalsha(sclient, "hot_chunk", [key], argv(rules, "C2", 1, 7)))
    assert tail[0] == 3 and tail[-1] == 0  # what the window had left
    denied = as_ints(evalsha(sclient, "hot_chunk", [key], argv(rules, "C3", 1, 7)))
    assert denied[:4] == [0, 0, 0, 1] and 0 < denied[4] <= 60_000  # the window's retry hint


def test_validity_ends_with_the_window_or_is_left_to_the_agent(sclient):
    t = tag()
    fw = as_ints(evalsha(sclient, "hot_chunk", [f"rl:{t}:fw", f"rl:{t}:tb"],
                         argv([RuleSpec("fw", (100, 2_000, 1, 0, 0)), RuleSpec("tb", (9_000, 1_000, 1_000, 1_000, 0))],
                              "C1", 1, 5)))
    assert fw[0] == 5 and 0 < fw[1] <= 2_000  # the fixed window's end
    tb = as_ints(evalsha(sclient, "hot_chunk", [f"rl:{t}:tb2"], argv([RuleSpec("tb", (9_000, 1_000, 1_000, 1_000, 0))],
                                                                      "C2", 1, 5)))
    assert tb[:2] == [5, -1]  # a bucket has no end: the agent's own validity bounds the chunk


@pytest.mark.parametrize("bad", [
    [SLACK, "C", 1, 5, "cc", 3, 2_000, 0, 0, 0],  # a concurrency gate cannot be chunked
    [SLACK, "C", 3, 2, "fw", 5, 1_000, 1, 0, 0],  # want < min
    [SLACK, "", 1, 2, "fw", 5, 1_000, 1, 0, 0],  # no member
    [SLACK, "C", 6, 6, "fw", 5, 1_000, 1, 0, 0],  # min units beyond... (denied, not invalid: see below)
])
def test_invalid_arguments_write_nothing(sclient, bad):
    key = f"rl:{tag()}:x"
    if bad[2] == 6:
        assert as_ints(evalsha(sclient, "hot_chunk", [key], bad))[:5] == [0, 0, 0, 1, -1]  # 6 > limit 5: never
    else:
        with pytest.raises(Exception, match="arguments invalid"):
            evalsha(sclient, "hot_chunk", [key], bad)
    assert sclient.exists(key) == 0


@pytest.mark.parametrize(("rule", "want", "taken"), [
    (RuleSpec("fw", (2**40, 2**12, 2**30, 0, 0)), 2**11, 2**10),  # a cost above 2^40 is beyond the range
    (RuleSpec("tb", (2**40, 1, 1, 2**39, 0)), 2**30, 2),  # costs above 2^63 too (their %d is not the number)
])
def test_counts_beyond_a_rules_range_are_denied_as_the_model_denies_them(sclient, rule, want, taken):
    """A count whose cost is beyond a rule's argument range is a denied count, found by the search
    as the model finds it: the chunk is the largest count within the range (and the rule's room)."""
    key = f"rl:{tag()}:{rule.kind}"
    reply = hot_chunk.reply_of(evalsha(sclient, "hot_chunk", [key], argv([rule], "C", 1, want)))
    expected, _ = hot_chunk.take([None], [rule], 0, "C", 1, want)
    assert reply[0] == taken and reply == expected


def test_a_sliding_log_chunk_stops_at_1000_entries(sclient):
    """A sliding log adds at most 1,000 entries a request: a larger count is beyond its range, and
    the chunk is 1,000 units."""
    key = f"rl:{tag()}:sl"
    reply = as_ints(evalsha(sclient, "hot_chunk", [key], argv([RuleSpec("sl", (5_000, 10_000, 1, 0, 0))], "C", 1,
                                                              1_500)))
    assert reply[0] == 1_000 and reply[2:] == [1, 0, 0, 4_000]
    assert sclient.zcard(key) == 1_000


@pytest.mark.parametrize(("slots", "lo", "want"), [
    ([RuleSpec("sl", (5_000, 60_000, 1, 0, 0))], 1, 999),  # below the bound
    ([RuleSpec("sl", (5_000, 60_000, 1, 0, 0))], 1, 1_000),  # at it
    ([RuleSpec("sl", (5_000, 60_000, 1, 0, 0))], 1, 1_001),  # above it: 1,000 units
    ([RuleSpec("sl", (5_000, 60_000, 1, 0, 0))], 999, 1_500),
    ([RuleSpec("sl", (5_000, 60_000, 1, 0, 0))], 1_000, 1_001),  # min at the bound
    ([RuleSpec("sl", (5_000, 60_000, 3, 0, 0))], 1, 400),  # three entries a unit: 333 units
    ([RuleSpec("sl", (1_300, 60_000, 1, 0, 0))], 1, 1_500),  # the second chunk is the log's room (300)
    ([RuleSpec("fw", (5_000, 60_000, 1, 0, 0)), RuleSpec("sl", (5_000, 60_000, 2, 0, 0))], 1, 800),  # 500 units
])
def test_sliding_log_counts_at_below_and_above_1000_entries_match_the_model(sclient, slots, lo, want):
    """A count whose log entries would pass 1,000 is denied in model and script alike (the search
    finds the largest count within the bound); two chunks on the same keys, states compared."""
    kinds = [r.kind for r in slots]
    t = tag()
    keys = [f"rl:{t}:r{i}:{k}" for i, k in enumerate(kinds)]
    states: list = [None] * len(kinds)
    taken = []
    for member in ("C1", "C2"):
        def model(n, s=states, member=member):
            return hot_chunk.take(s, slots, n, member, lo, want)

        def call(member=member):
            return hot_chunk.reply_of(evalsha(sclient, "hot_chunk", keys, argv(slots, member, lo, want)))

        n, states = step(call, model, lambda: read_rules(sclient, kinds, keys), states, kinds, reply_of=lambda r: r)
        taken.append(model(n)[0][0])
    entries = max(r.params[2] for r in slots if r.kind == "sl")
    assert 0 < taken[0] * entries <= 1_000  # the bound held: never more entries than a request may add


def test_a_min_count_beyond_1000_entries_is_invalid_in_model_and_script(sclient):
    key = f"rl:{tag()}:sl"
    rules = [RuleSpec("sl", (5_000, 60_000, 1, 0, 0))]
    with pytest.raises(Exception, match="arguments invalid"):
        evalsha(sclient, "hot_chunk", [key], argv(rules, "C", 1_001, 1_001))
    with pytest.raises(InvalidArguments):
        hot_chunk.take([None], rules, 0, "C", 1_001, 1_001)
    assert sclient.exists(key) == 0
