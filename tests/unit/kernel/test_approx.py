"""Approximate local counters (kernel/approx.py), pure: an injected clock, and the reconciliation
script's arithmetic as a dict (the script itself runs on a real redis-server in
tests/integration/scripts/test_approx_reconcile.py and through agents in
tests/integration/region_agent/test_approximate.py)."""

from __future__ import annotations

import random

import msgspec
import pytest

from kernel.algorithms import make_rule
from kernel.algorithms.rule import Approximate
from kernel.approx import ApproxCounters, StoreClock, approximate_bound, approximate_problems
from kernel.bound import approximate_bounds
from kernel.bundle import Bundle, seal

W = 60_000


def rule(algorithm="fixed_window", limit=100, local_max=10, reconcile_ms=1_000, **kw):
    return make_rule(id="ceiling", scope="tenant", algorithm=algorithm, fail_mode="local_bounded", limit=limit,
                     window_ms=W, approximate=Approximate(reconcile_ms=reconcile_ms, local_max=local_max), **kw)


class Store:
    """What lua/approx_reconcile.lua does to one key, as a dict: window index -> count."""

    def __init__(self):
        self.counts: dict[int, int] = {}

    def reconcile(self, counters: ApproxCounters, now_ms: int) -> None:
        for r in counters.due(now_ms):
            cur = now_ms // r.window_ms
            for idx, delta in r.deltas:
                if delta > 0 and idx >= cur - 1:
                    self.counts[min(idx, cur)] = self.counts.get(min(idx, cur), 0) + delta
            counters.reconciled(r.key, now_ms, self.counts.get(cur, 0), self.counts.get(cur - 1, 0))


def test_one_agent_counts_locally_and_stops_at_local_max_until_it_reconciles():
    c, store, r = ApproxCounters(), Store(), rule(limit=100, local_max=10)
    now = 5 * W + 10
    got = [c.take("k", r, 1, now) for _ in range(12)]
    assert [g.allowed for g in got] == [True] * 10 + [False, False]
    assert got[10].local_cap and got[10].retry_ms == 1_000  # its next reconciliation
    assert "k" in c.urgent  # reconcile now, not at the interval
    store.reconcile(c, now)
    assert store.counts == {5: 10}
    assert c.take("k", r, 1, now).allowed


def test_one_agent_alone_admits_exactly_the_limit():
    c, store, r = ApproxCounters(), Store(), rule(limit=100, local_max=10)
    now, admitted = 5 * W, 0
    for i in range(300):
        admitted += c.take("k", r, 1, now + i).allowed
        store.reconcile(c, now + i)
    assert admitted == 100 and store.counts[5] == 100


def test_a_denial_elsewhere_gives_the_units_back():
    c, r = ApproxCounters(), rule()
    t = c.take("k", r, 3, 10)
    assert t.allowed and t.ticket == ("k", 0, 3)
    c.give_back(t.ticket)
    assert c.keys["k"].unseen_all() == 0


def test_a_failed_reconciliation_is_sent_again():
    c, r = ApproxCounters(), rule()
    for _ in range(4):
        c.take("k", r, 1, 100)
    (first,) = c.due(2_000)
    assert first.deltas == ((0, 4),)
    c.failed("k")
    assert c.due(2_500) == []  # not before its next interval (a failing store is not hammered)
    (again,) = c.due(3_000)
    assert again.deltas == ((0, 4),)


def test_units_of_windows_no_decision_reads_are_dropped():
    c, r = ApproxCounters(), rule(local_max=5)
    for _ in range(5):
        assert c.take("k", r, 1, 100).allowed
    assert not c.take("k", r, 1, 200).allowed  # local max reached, Redis never answered
    # two windows later nothing of window 0 matters any more: the process admits again
    assert c.take("k", r, 1, 2 * W + 5).allowed


def test_the_sliding_counter_weighs_the_previous_window():
    c, store, r = ApproxCounters(), Store(), rule("sliding_counter", limit=100, local_max=100)
    for i in range(100):
        assert c.take("k", r, 1, W + i).allowed  # window 1
    store.reconcile(c, W + 200)
    half = 2 * W + W // 2  # window 2, half elapsed: the previous 100 weigh 50
    store.reconcile(c, half)
    admitted = sum(c.take("k", r, 1, half).allowed for _ in range(80))
    assert admitted == 50


def test_the_store_clock_offset_is_the_middle_of_the_round_trip():
    clock = StoreClock()
    assert clock.now(10.0, 1_000_000.0) == 1_000_000.0
    clock.observe(100.0, 104.0, 5_000)
    assert clock.now(202.0, 0.0) == 5_100.0


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_counter"])
@pytest.mark.parametrize("seed", range(12))
def test_several_agents_never_count_more_than_the_bound(algorithm, seed):
    rnd = random.Random(seed)
    agents = rnd.randint(2, 6)
    limit, local_max = rnd.randint(50, 400), rnd.randint(1, 40)
    r = rule(algorithm, limit=limit, local_max=local_max, reconcile_ms=rnd.choice([50, 200, 1_000]))
    store = Store()
    counters = [ApproxCounters() for _ in range(agents)]
    admitted: dict[int, int] = {}
    now = 3 * W
    for _ in range(6_000):
        now += rnd.randint(0, 40)
        a = rnd.randrange(agents)
        if rnd.random() < 0.1:
            store.reconcile(counters[a], now)
        elif rnd.random() < 0.02:  # a lost reply: the delta was applied, the agent sends it again
            for rec in counters[a].due(now):
                for idx, delta in rec.deltas:
                    store.counts[idx] = store.counts.get(idx, 0) + delta
                counters[a].failed(rec.key)
        else:
            cost = rnd.choice([1, 1, 1, 2])
            if counters[a].take("k", r, cost, now).allowed:
                admitted[now // W] = admitted.get(now // W, 0) + cost
    bound = approximate_bound(r, agents).total
    assert bound == limit + (agents - 1) * local_max
    assert admitted and max(admitted.values()) <= bound
    assert len(admitted) >= 2  # the run crossed windows


def test_validation_refuses_what_cannot_be_approximate():
    assert approximate_problems(rule()) == []
    tb = make_rule(id="tb", scope="tenant", algorithm="token_bucket", fail_mode="local_bounded", capacity_millis=5000,
                   refill_millis=1000, period_ms=1000, cost_millis=1000,
                   approximate=Approximate(reconcile_ms=100, local_max=1))
    assert approximate_problems(tb)[0].startswith(
        "approximate applies to fixed_window and sliding_counter rules only, not token_bucket")
    bad = msgspec.structs.replace(rule(limit=10, local_max=11, reconcile_ms=W), fail_mode="open", concurrency_max=2,
                                  shadow=True)
    assert approximate_problems(bad) == [
        "approximate localMax 11 exceeds the limit 10",
        f"approximate reconcileMs {W} must be shorter than windowMs {W}",
        "an approximate rule answers from its local counter whether Redis answers or not: failMode must be "
        "local_bounded",
        "an approximate rule carries no concurrency gate",
        "a shadow rule cannot be approximate"]


def test_the_bundle_names_the_rule_and_the_bound_lists_it():
    from kernel.bundle import decode_bundle, encode_bundle
    from kernel.errors import PolicyError

    b = seal(Bundle(bundle_version=1, published_at="2030-01-01T00:00:00Z", checksum="", rules=[rule()]))
    assert decode_bundle(encode_bundle(b)).rules[0].approximate == Approximate(1_000, 10)
    assert b'"approximate"' in encode_bundle(b)
    (bound,) = approximate_bounds(b, 3)
    assert (bound.rule, bound.total) == ("ceiling", 120)
    assert "100 + (3 agent process(es) - 1) x localMax 10 = 120" in bound.formula
    worse = seal(msgspec.structs.replace(b, rules=[rule(local_max=101)]))
    with pytest.raises(PolicyError, match="rule 'ceiling': approximate localMax 101 exceeds the limit 100"):
        decode_bundle(encode_bundle(worse))
    raw = encode_bundle(b).replace(b'"reconcileMs": 1000', b'"reconcileMs": 5')
    with pytest.raises(PolicyError, match="reconcileMs"):
        decode_bundle(raw)


def test_a_rule_is_approximate_or_takes_hot_chunks_never_both():
    from kernel.algorithms.rule import HotChunk
    from kernel.bundle import hot_chunk_problems

    both = msgspec.structs.replace(rule(), hot_chunk=HotChunk(threshold_per_s=100))
    assert hot_chunk_problems(both) == [
        "hotChunk and approximate exclude each other (an approximate rule already admits without a store call)"]
    assert hot_chunk_problems(msgspec.structs.replace(rule(), approximate=None, hot_chunk=HotChunk(100))) == []
