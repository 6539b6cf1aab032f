"""What each algorithm's rule Struct says about itself (kernel/algorithms/rule.py and the Struct in
each algorithm's module): its script slot, its header numbers, its local model, its validation.
Every registered algorithm appears in the table, so an algorithm added without its row fails."""

from __future__ import annotations

import pytest

from kernel.algorithms import ALGORITHMS, KINDS, LocalModel, Role, make_rule
from kernel.algorithms.rule import Rate
from kernel.bundle import Fallback, Pool

POOLS = {"p": Pool(id="p", window_ms=60_000, limit=1_000, lease_ttl_ms=10_000, chunk_min=10, chunk_max=100,
                   fallback_per_region=100)}
BUCKET = dict(capacity_millis=20_000, refill_millis=2_000, period_ms=1_000, cost_millis=1_000)
WINDOW = dict(limit=20, window_ms=10_000)

# algorithm -> (fields, kind, script params at costHint 3, limit, window for the headers, remaining per raw 7_500,
#               rate, local model)
TABLE = {
    "token_bucket": (BUCKET, "tb", (20_000, 2_000, 1_000, 3_000, 0), 20, 10_000, 7, Rate(2_000, 1_000, True),
                     LocalModel.FALLBACK),
    "gcra": (BUCKET, "gcra", (20_000, 2_000, 1_000, 3_000, 0), 20, 10_000, 7, Rate(2_000, 1_000, True),
             LocalModel.FALLBACK),
    "fixed_window": (WINDOW, "fw", (20, 10_000, 3, 0, 0), 20, 10_000, 7_500, Rate(20_000, 10_000, False),
                     LocalModel.FALLBACK),
    "sliding_counter": (WINDOW, "sc", (20, 10_000, 3, 0, 0), 20, 10_000, 7_500, Rate(20_000, 10_000, False),
                        LocalModel.FALLBACK),
    "sliding_log": (WINDOW, "sl", (20, 10_000, 3, 0, 0), 20, 10_000, 7_500, Rate(20_000, 10_000, False),
                    LocalModel.FALLBACK),
    "pool": (dict(pool="p", cost=2), "pool", (6, 0, 0, 0, 0), 1_000, 60_000, 7_500, Rate(1_000_000, 60_000, False),
             LocalModel.POOL_ALLOWANCE),
}


def rule(name: str, **extra):
    fields = {**TABLE[name][0], **extra}
    return make_rule(id=f"r-{name}", scope="tenant", tenant="atlas", algorithm=name, fail_mode="local_bounded",
                     **fields)


def test_every_registered_algorithm_has_a_row():
    assert set(TABLE) == set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_what_the_strategy_says(name):
    _, kind, params, limit, window, remaining, rate, local = TABLE[name]
    r = rule(name)
    assert r.algorithm == name and r.kind is KINDS[kind]
    assert r.script_params(3) == params
    assert r.limit_tokens(POOLS) == limit
    assert r.policy_window_ms(POOLS) == window
    assert r.remaining_tokens(7_500) == remaining and r.remaining_tokens(-5) == 0
    assert r.rate(POOLS) == rate
    assert r.local_model is local
    assert r.problems(POOLS) == []
    assert (r.role is Role.POOL) == (name == "pool") and r.pool_id == ("p" if name == "pool" else None)
    assert r.exact_hint == (name != "pool")  # a top-up may come before a pool's hint


@pytest.mark.parametrize("name", sorted(n for n in TABLE if n != "pool"))
def test_missing_fields_are_named(name):
    r = make_rule(id="x", scope="tenant", algorithm=name, fail_mode="closed")
    [problem] = r.problems(POOLS)
    assert problem.startswith(f"{name} needs ")


def test_bucket_and_window_limits_on_products_and_cost():
    assert rule("token_bucket", cost_millis=30_000).problems(POOLS) == [
        "costMillis 30000 exceeds capacityMillis 20000: the request could never succeed"]
    big = make_rule(id="x", scope="tenant", algorithm="fixed_window", fail_mode="closed", limit=2**30, window_ms=2**30)
    assert big.problems(POOLS) == ["limit x windowMs must be at most 2^52"]


def test_pool_rule_problems():
    assert make_rule(id="x", scope="tenant", algorithm="pool", fail_mode="closed").problems(POOLS) == [
        "algorithm pool needs a pool id"]
    assert "not defined" in make_rule(id="x", scope="tenant", algorithm="pool", pool="q",
                                      fail_mode="closed").problems(POOLS)[0]
    assert "cannot fail open" in " ".join(make_rule(id="x", scope="tenant", algorithm="pool", pool="p",
                                                    fail_mode="open").problems(POOLS))
    fleet = make_rule(id="g", scope="global", algorithm="pool", pool="p", fail_mode="closed")
    assert fleet.fleet_wide and not rule("pool").fleet_wide


def test_local_model_of_a_rule_is_its_fallback_bucket_or_window():
    bucket = rule("sliding_log", fallback=Fallback(capacity_millis=10_000, refill_millis=1_000, period_ms=1_000))
    assert bucket.fallback_call(2) == ("tb", (10_000, 1_000, 1_000, 2_000, 0), 1000)
    window = rule("token_bucket", fallback=Fallback(limit=5, window_ms=1_000))
    assert window.fallback_call(2) == ("fw", (5, 1_000, 2, 0, 0), 1)
    # a bucket rule's fallback bucket charges its own costMillis per unit
    assert rule("token_bucket", cost_millis=500,
                fallback=Fallback(capacity_millis=10_000, refill_millis=1_000, period_ms=1_000)).fallback_call(2)[1][3] \
        == 1_000


def test_capacities_per_key():
    assert rule("token_bucket").capacity(POOLS) == (2.0, 20.0)
    assert rule("fixed_window").capacity(POOLS) == (2.0, 20.0)
    assert rule("pool").capacity(POOLS) == (1_000 * 1000 / 60_000 / 2, 500.0)
    assert rule("pool").fallback_capacity(POOLS) == (100 * 1000 / 60_000, 100.0)
    closed = make_rule(id="c", scope="tenant", algorithm="pool", pool="p", fail_mode="closed")
    assert closed.fallback_capacity(POOLS) == (0.0, 0.0)
