"""Hypothesis differential tests: the real scripts against the pure models.

Each call is bracketed by the local clock (Redis TIME reads the same machine clock); the reply
and the state read back must equal the model's for some instant inside the bracket, and that
instant advances the model. A sleep of d ms is simulated by moving every stored timestamp d ms
back (Redis and model alike); fixed window and sliding counter are aligned to absolute time, so
they use small windows and real short sleeps."""

from __future__ import annotations

import time
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.algorithms import (
    concurrency,
    fixed_window,
    gcra,
    multi_rule,
    pool,
    sliding_counter,
    sliding_log,
)
from kernel.algorithms import token_bucket as tb
from kernel.algorithms.concurrency import ConcurrencyParams
from kernel.algorithms.fixed_window import WindowParams
from kernel.algorithms.multi_rule import DecisionRecord
from kernel.algorithms.pool import PoolEntry, PoolState
from kernel.algorithms.token_bucket import TokenBucketParams
from region_agent.store.lua_loader import variant_name

from .support import (
    SETTINGS,
    SLACK,
    deposit_grants,
    evalsha,
    make_rule,
    norm,
    now_ms,
    read_rules,
    read_state,
    shift_back,
    shift_model,
    shift_rules,
    step,
    tag,
)

pytestmark = pytest.mark.integration

def single_step(r, kind, name, key, argv, decide, state):
    """One call of a single-key rate script; ``decide(state, now_ms=n)`` is the model."""
    def call():
        return evalsha(r, name, [key], argv)

    def model(n):
        d, new = decide(state, now_ms=n)
        return d, None if new is None else [new]

    _, (new_state,) = step(call, model, lambda: [read_state(r, kind, key)], [state], [kind])
    return new_state


# --- token bucket and GCRA (simulated sleeps) --------------------------------------------------
bucket_params = st.builds(
    lambda cap, refill, period: (cap, refill, period),
    st.integers(1, 50_000), st.integers(1, 20_000), st.integers(1, 5_000))
sleeps = st.sampled_from([0, 0, 0, 1, 7, 250, 999, 5_000, 10**7])


@pytest.mark.parametrize("kind", ["tb", "gcra"])
@settings(SETTINGS, max_examples=40)
@given(p=bucket_params, ops=st.lists(st.tuples(sleeps, st.integers(1, 1_100), st.booleans()), min_size=1,
                                      max_size=14))
def test_bucket_scripts_match_model(sclient, kind, p, ops):
    key = f"rl:{tag()}:{kind}"
    cap, refill, period = p
    state = None
    for d, permille, lowered in ops:
        shift_back(sclient, kind, key, d)
        state = shift_model(kind, state, d)
        capacity = max(1, cap // 3) if lowered else cap
        cost = max(1, cap * permille // 1_000)  # mostly <= capacity, sometimes above
        params = TokenBucketParams(capacity, refill, period, cost)
        mod = tb if kind == "tb" else gcra
        name = "token_bucket" if kind == "tb" else "gcra"
        state = single_step(sclient, kind, name, key, [capacity, refill, period, cost, SLACK],
                            partial(mod.decide, params=params), state)
        if state is not None:
            assert sclient.pttl(key) > 0


# --- fixed window and sliding counter (real short sleeps) --------------------------------------
@pytest.mark.parametrize("kind", ["fw", "sc"])
@SETTINGS
@given(window=st.integers(20, 120), limit=st.integers(1, 6),
       ops=st.lists(st.tuples(st.sampled_from([0, 0, 0, 3, 15, 40]), st.integers(1, 7)), min_size=1, max_size=12))
def test_window_scripts_match_model(sclient, kind, window, limit, ops):
    key = f"rl:{tag()}:{kind}"
    mod = fixed_window if kind == "fw" else sliding_counter
    name = "fixed_window" if kind == "fw" else "sliding_counter"
    state = None
    for d, cost in ops:
        if d:
            time.sleep(d / 1000)
        params = WindowParams(limit, window, cost)
        state = single_step(sclient, kind, name, key, [limit, window, cost, SLACK],
                            partial(mod.decide, params=params), state)
        if state is not None:
            assert sclient.pttl(key) > 0


# --- sliding log -------------------------------------------------------------------------------
@SETTINGS
@given(limit=st.integers(1, 6), window=st.integers(10, 5_000),
       ops=st.lists(st.tuples(st.sampled_from([0, 0, 1, 30, 400, 2_000]), st.integers(1, 3),
                              st.integers(0, 5)), min_size=1, max_size=14))
def test_sliding_log_matches_model(sclient, limit, window, ops):
    key = f"rl:{tag()}:sl"
    state = None
    for i, (d, cost, replay) in enumerate(ops):
        shift_back(sclient, "sl", key, d)
        state = shift_model("sl", state, d)
        member = f"m{replay}" if replay < i and replay % 2 == 0 else f"m{i}"
        params = WindowParams(limit, window, cost)
        state = single_step(sclient, "sl", "sliding_log", key, [limit, window, member, cost, SLACK],
                            partial(sliding_log.decide, params=params, member=member), state)
        if state is not None and state.entries:
            assert sclient.pttl(key) > 0


# --- concurrency -------------------------------------------------------------------------------
@SETTINGS
@given(max_in_flight=st.integers(1, 4), ttl=st.integers(5, 3_000),
       ops=st.lists(st.tuples(st.sampled_from(["acq", "acq", "rel", "renew"]), st.integers(0, 5),
                              st.sampled_from([0, 0, 2, 100, 1_000, 4_000])), min_size=1, max_size=16))
def test_concurrency_matches_model(sclient, max_in_flight, ttl, ops):
    key = f"rl:{tag()}:cc"
    params = ConcurrencyParams(max_in_flight, ttl)
    state = None
    for op, lease, d in ops:
        shift_back(sclient, "cc", key, d)
        state = shift_model("cc", state, d)
        lid = f"L{lease}"
        if op == "acq":
            def model(n, s=state, lid=lid):
                dd, new = concurrency.acquire(s, params, n, lid)
                return [int(dd.allowed), dd.remaining], None if new is None else [new]
            def call(lid=lid):
                return evalsha(sclient, "concurrency_acquire", [key], [lid, max_in_flight, ttl])
        elif op == "rel":
            def model(n, s=state, lid=lid):
                ok, k, new = concurrency.release(s, n, lid)
                return [int(ok), k], None if new is None else [new]
            def call(lid=lid):
                return evalsha(sclient, "concurrency_release", [key], [lid])
        else:
            def model(n, s=state, lid=lid):
                ok, k, new = concurrency.renew(s, params, n, lid)
                return [int(ok), k], None if new is None else [new]
            def call(lid=lid):
                return evalsha(sclient, "concurrency_renew", [key], [lid, ttl])
        _, (state,) = step(call, model, lambda: [read_state(sclient, "cc", key)], [state], ["cc"],
                           reply_of=lambda r: r)
        assert sclient.pttl(key) != -1  # never a key without an expiry


# --- mixed multi-rule sets ---------------------------------------------------------------------
rule_kinds = st.lists(st.sampled_from(["tb", "gcra", "fw", "sc", "sl", "cc", "pool", "pw"]), min_size=1, max_size=5)


@SETTINGS
@given(kinds=rule_kinds,
       grants=st.lists(st.tuples(st.integers(0, 6), st.integers(-500, 500), st.integers(600, 5_000)), max_size=3),
       ops=st.lists(st.tuples(st.sampled_from([0, 0, 1, 300, 1_500, 6_000]), st.integers(1, 3),
                              st.integers(0, 3)), min_size=1, max_size=10),
       lean=st.booleans())
def test_multi_rule_matches_model(sclient, kinds, grants, ops, lean):
    """``multi_rule.lua`` — or, with ``lean``, its variant with only these kinds' libraries, the
    script the agent runs — against ``multi_rule.decide``."""
    t = tag()
    keys = [f"rl:{t}:r{i}:{k}" if k != "pool" else f"rl:{t}:pool" for i, k in enumerate(kinds)]
    kinds = [k for i, k in enumerate(kinds) if keys[i] not in keys[:i]]
    keys = list(dict.fromkeys(keys))
    script = variant_name("multi_rule", kinds) if lean else "multi_rule"  # the agent's: the lean variant
    states: list = [None] * len(kinds)
    if "pool" in kinds:
        j = kinds.index("pool")
        states[j] = deposit_grants(sclient, keys[j], grants)
    for i, (d, cost, replay) in enumerate(ops):
        states = shift_rules(sclient, kinds, keys, states, d)
        member = f"D{replay}" if replay < i else f"D{i}"
        rules = [make_rule(k, cost) for k in kinds]
        argv = [SLACK, 0, member] + [x for r in rules for x in (r.kind, *r.params)] + [""]

        def model(n, s=states, rules=rules, member=member):
            return multi_rule.decide(s, rules, n, member)

        _, states = step(lambda argv=argv: evalsha(sclient, script, [f"rl:{t}:dec", *keys], argv),
                         model, lambda: read_rules(sclient, kinds, keys),
                         states, kinds)
        for k, key, s in zip(kinds, keys, states, strict=True):
            if norm(k, s, now_ms()) is not None:
                assert sclient.pttl(key) > 0 or k == "cc", k
            assert sclient.pttl(key) != -1, k


@SETTINGS
@given(kinds=st.lists(st.sampled_from(["tb", "fw", "sl", "cc"]), min_size=1, max_size=3, unique=True),
       calls=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["", "qA", "qB"]), st.integers(1, 3)),
                      min_size=1, max_size=10),
       lean=st.booleans())
def test_decision_records_match_model(sclient, kinds, calls, lean):
    """Decision records (decision_ttl_ms > 0) against ``multi_rule.decide_recorded``: a record
    replays its reply to the same question and changes nothing, answers the conflict reply to
    another question and changes nothing, and is written (with its question) by a first call."""
    t = tag()
    keys = [f"rl:{t}:r{i}:{k}" for i, k in enumerate(kinds)]
    script = variant_name("multi_rule", kinds) if lean else "multi_rule"  # the agent's: the lean variant
    states: list = [None] * len(kinds)
    records: dict[int, DecisionRecord] = {}
    for did, question, cost in calls:
        member = f"D{did}"
        dkey = f"rl:{t}:dec:{did}"
        rules = [make_rule(k, cost) for k in kinds]
        argv = [SLACK, 60_000, member] + [x for r in rules for x in (r.kind, *r.params)] + [question]

        def model(n, s=states, rules=rules, member=member, did=did, question=question):
            reply, new, _ = multi_rule.decide_recorded(records.get(did), s, rules, n, member, question)
            return reply, new

        n, states = step(lambda argv=argv, dkey=dkey: evalsha(sclient, script, [dkey, *keys], argv),
                         model, lambda: read_rules(sclient, kinds, keys),
                         states, kinds, reply_of=lambda reply: reply)
        records[did] = multi_rule.decide_recorded(records.get(did), [None] * len(kinds), rules, n, member,
                                                  question)[2] if did in records else \
            DecisionRecord(question, tuple(model(n)[0]))
        stored = sclient.get(dkey).decode()
        assert stored == records[did].question + "|" + ",".join(str(x) for x in records[did].reply)
        assert 0 < sclient.pttl(dkey) <= 60_000


def test_pool_model_deposit_matches_script(sclient):
    key = f"rl:{tag()}:pool"
    base = now_ms()
    state = None
    for lid, granted, off, life, mx in [("A", 5, 0, 1_000, 2), ("A", 9, 0, 1_000, 2), ("B", 1, 10, 50_000, 2),
                                        ("C", 1, 0, 1_000, 2), ("D", 1, -5_000, 10, 9)]:
        status, new = pool.deposit(state, lid, granted, base + off, base + off + life, mx, now_ms())
        res = evalsha(sclient, "pool_deposit", [key], [lid, granted, base + off, base + off + life, mx, SLACK])
        assert (res[1].decode() if isinstance(res[1], bytes) else res[1]) == status
        state = new if new is not None else state
        assert norm("pool", read_state(sclient, "pool", key)) == norm("pool", state)


@SETTINGS
@given(grants=st.lists(st.tuples(st.integers(0, 9), st.integers(-500, 500), st.integers(600, 5_000)),
                       min_size=1, max_size=4),
       takes=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 12), st.sampled_from([None, 0, 1, 3, 10, 40]),
                                 st.sampled_from([None, 0, 2, 9])),
                      min_size=1, max_size=6))
def test_pool_take_matches_model(sclient, grants, takes):
    key = f"rl:{tag()}:pool"
    base = now_ms()
    entries = {}
    for g, (granted, from_off, life) in enumerate(grants):
        evalsha(sclient, "pool_deposit", [key], [f"G{g}", granted, base + from_off, base + from_off + life, 8, SLACK])
        entries[f"G{g}"] = PoolEntry(granted, 0, base + from_off, base + from_off + life)
    state = PoolState(entries)
    for lo, extra, per_s, waiting in takes:  # None: the three- or four-argument form
        want = lo + extra
        if per_s is None:
            waiting = None

        def model(n, s=state, lo=lo, want=want, per_s=per_s, waiting=waiting):
            reply, new = pool.take(s, lo, want, n, per_s=per_s or 0, waiting=waiting or 0)
            # the debits flattened as the script sends them, lease ids numbered (G<i> -> i)
            flat = [x for lid, tokens in reply[4] for x in (int(lid[1:]), tokens)]
            return list(reply[:4]) + flat, None if new is None else [new]

        def call(lo=lo, want=want, per_s=per_s, waiting=waiting):
            r = evalsha(sclient, "pool_take", [key], [lo, want, SLACK] + ([] if per_s is None else [per_s])
                        + ([] if waiting is None else [waiting]))
            flat = [int(x.decode()[1:]) if isinstance(x, bytes) else x for x in r[4]]
            return list(r[:4]) + flat

        _, (state,) = step(call, model, lambda: [read_state(sclient, "pool", key)], [state], ["pool"],
                           reply_of=lambda r: r)
