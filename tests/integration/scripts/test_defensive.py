"""Defensive rules through the real scripts: error replies before any read/write, denials that
change nothing, an expiry on every written key."""

from __future__ import annotations

import pytest

from kernel.errors import ScriptRejected
from region_agent.decision.call import Call, MultiRuleResult, multi_rule_argv

from .support import now_ms

pytestmark = pytest.mark.integration

T = "{t:def}"
BAD = ["nan", "inf", "-inf", "1.5", "-1", "0", str(2**40 + 1), "abc", "", "1e400"]

# script -> (good ARGV, indexes of numeric ARGV with min 1, indexes with min 0)
SINGLE = {
    "token_bucket": (["20000", "2000", "1000", "1000", "5000"], [0, 1, 2, 3], [4]),
    "gcra": (["20000", "2000", "1000", "1000", "5000"], [0, 1, 2, 3], [4]),
    "fixed_window": (["20", "10000", "1", "2000"], [0, 1, 2], [3]),
    "sliding_counter": (["20", "10000", "1", "2000"], [0, 1, 2], [3]),
    "sliding_log": (["20", "10000", "m1", "1", "2000"], [0, 1, 3], [4]),
    "concurrency_acquire": (["L1", "3", "60000"], [1, 2], []),
    "concurrency_renew": (["L1", "60000"], [1], []),
    "pool_deposit": (["P1", "10", "1", str(2**45), "4", "1000"], [4], [1, 5]),
}
SEED_STATE = {
    "token_bucket": lambda r, k: r.hset(k, mapping={"tokens": 7_000, "ts": now_ms()}),
    "gcra": lambda r, k: r.set(k, now_ms() + 1_000),
    "fixed_window": lambda r, k: r.hset(k, mapping={"w": now_ms() - now_ms() % 10_000, "n": 3}),
    "sliding_counter": lambda r, k: r.hset(k, mapping={"w": now_ms() - now_ms() % 10_000, "cur": 3, "prev": 1}),
    "sliding_log": lambda r, k: r.zadd(k, {"old": now_ms()}),
    "concurrency_acquire": lambda r, k: r.zadd(k, {"L0": now_ms() + 60_000}),
    "concurrency_renew": lambda r, k: r.zadd(k, {"L1": now_ms() + 60_000}),
    "pool_deposit": lambda r, k: r.hset(k, "P0", f"5,1,0,{now_ms() + 60_000}"),
}


def cases():
    for name, (good, pos1, pos0) in SINGLE.items():
        for i in pos1 + pos0:
            for bad in BAD:
                if i in pos0 and bad == "0":
                    continue
                argv = list(good)
                argv[i] = bad
                yield name, argv
    yield "token_bucket", ["20000", "0", "1000", "1000", "0"]  # refill 0
    yield "token_bucket", [str(2**40), "1", str(2**12 + 1), "1", "0"]  # capacity x period > 2^52
    yield "gcra", [str(2**40), "1", str(2**12 + 1), "1", "0"]
    yield "fixed_window", [str(2**30), str(2**23), "1", "0"]  # limit x window > 2^52
    yield "sliding_counter", [str(2**30), str(2**23), "1", "0"]
    yield "sliding_log", [str(2**30), str(2**23), "m", "1", "0"]
    yield "sliding_log", ["20", "10000", "", "1", "0"]  # empty member
    yield "sliding_log", ["5000", "10000", "m", "1001", "0"]  # more than 1,000 entries per request
    yield "token_bucket", ["20000", "2000", "1000", "1000"]  # missing ARGV
    yield "pool_deposit", ["P1", "10", "100", "100", "4", "0"]  # expires_at <= valid_from
    for bad in ("nan", "inf", "-1", "1.5", "abc", str(2**50 + 1)):
        yield "pool_deposit", ["P1", "10", bad, str(2**45), "4", "0"]  # times: [0, 2^50] ms
    yield "pool_deposit", ["P,1", "10", "1", "100", "4", "0"]  # a comma would corrupt the packing


@pytest.mark.parametrize(("name", "argv"), list(cases()))
async def test_bad_arguments_rejected_before_any_write(aclient, scripts, name, argv):
    key = f"rl:v3:{T}:bad:{name}"
    await SEED_STATE[name](aclient, key)
    before, ttl = await aclient.dump(key), await aclient.pttl(key)
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, name, [key], argv)
    assert await aclient.dump(key) == before and await aclient.pttl(key) == ttl


def rule_sets():
    tb = ["tb", "20000", "2000", "1000", "1000", "0"]
    yield "unknown kind", [["leaky", "1", "1", "1", "1", "0"]]
    yield "nine rules", [tb] * 9
    yield "bad second rule", [tb, ["fw", "20", "0", "1", "0", "0"]]
    yield "nan in a later rule", [tb, ["gcra", "20000", "nan", "1000", "1000", "0"]]
    yield "cc needs a member", [["cc", "3", "1000", "0", "0", "0"]]


@pytest.mark.parametrize(("label", "rules"), list(rule_sets()))
async def test_multi_rule_validates_everything_first(aclient, scripts, label, rules):
    keys = [f"rl:v3:{T}:d:x"] + [f"rl:v3:{T}:r{i}" for i in range(len(rules))]
    member = "" if label == "cc needs a member" else "D1"
    argv = ["100", "5000", member] + [a for r in rules for a in r] + ["q1"]
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "multi_rule", keys, argv)
    assert await aclient.exists(*keys) == 0


async def test_multi_rule_rejects_duplicate_keys_and_bad_header(aclient, scripts):
    k = f"rl:v3:{T}:dup"
    tb = ["tb", "20000", "2000", "1000", "1000", "0"]
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "multi_rule", [f"rl:v3:{T}:d", k, k], ["0", "0", "m", *tb, *tb, ""])
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "multi_rule", [f"rl:v3:{T}:d", k], ["-1", "0", "m", *tb, ""])
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "multi_rule", [f"rl:v3:{T}:d", k], ["0", "0", "m", *tb, "", "extra"])
    with pytest.raises(ScriptRejected):  # no question argument
        await scripts.call(aclient, "multi_rule", [f"rl:v3:{T}:d", k], ["0", "5000", "m", *tb])
    for question in ("a|b", "a,b", "x" * 65, "a b", "\u00e9"):  # the record's separators, length, charset
        with pytest.raises(ScriptRejected):
            await scripts.call(aclient, "multi_rule", [f"rl:v3:{T}:d", k], ["0", "5000", "m", *tb, question])
    assert await aclient.exists(f"rl:v3:{T}:d") == 0
    with pytest.raises(ScriptRejected):
        multi_rule_argv("d", [Call(k, "tb", (1, 1, 1, 1, 0))] * 2, slack_ms=0, decision_ttl_ms=0, member="m")
    assert await aclient.exists(k) == 0


async def test_multi_rule_compares_every_pair_of_rule_keys_and_only_rule_keys(aclient, scripts):
    """A rule key listed again anywhere among the rules (not only next to itself) is refused before
    any write; the decision record's key is not a rule key (the agent's never equals one, and the
    script does not compare it): a rule on that key still runs."""
    d, k1, k2 = f"rl:v3:{T}:d", f"rl:v3:{T}:k1", f"rl:v3:{T}:k2"
    tb = ["tb", "20000", "2000", "1000", "1000", "0"]
    fw = ["fw", "20", "10000", "1", "0", "0"]
    for keys in ([d, k1, k2, k1], [d, k2, k1, k1], [d, k1, k1, k2]):
        with pytest.raises(ScriptRejected):
            await scripts.call(aclient, "multi_rule", keys, ["0", "0", "m", *tb, *fw, *tb, ""])
        assert await aclient.exists(d, k1, k2) == 0
    r = await scripts.multi_rule(aclient, [d, d, k1], ["0", "0", "m", *tb, *fw, ""])
    assert (r.allowed, r.remaining) == (True, (19_000, 19))


async def test_a_decision_record_holds_every_value_exactly_up_to_2_53(aclient, scripts):
    """A denial whose retry is near 2^52 ms (capacity 2^40 millitokens refilled 1 per 2^12 ms), recorded
    with its reply: the stored text is every value's exact decimal digits (no exponent, no rounding:
    '%.14g' would print 4.5035995768054e+15), and the replay answers the same integers."""
    d, k = f"rl:v3:{T}:rec-big", f"rl:v3:{T}:big-bucket"
    await aclient.hset(k, mapping={"tokens": 12_345, "ts": now_ms() + 60_000})  # ts ahead: no refill
    tb = ["tb", str(2**40), "1", str(2**12), str(2**40), "0"]
    retry = (2**40 - 12_345) * 2**12
    assert retry > 10**15
    for _ in range(2):  # the first call records, the second replays the record
        r = await scripts.multi_rule(aclient, [d, k], ["0", "60000", "m", *tb, "q7"])
        assert (r.allowed, r.denied_by, r.retry_after_ms, r.remaining) == (False, 1, retry, (12_345,))
        assert await aclient.get(d) == f"q7|0,1,{retry},12345".encode()


async def test_cost_over_capacity_never_and_untouched(aclient, scripts):
    key = f"rl:v3:{T}:big"
    await aclient.hset(key, mapping={"tokens": 1_000, "ts": now_ms()})
    before = await aclient.dump(key)
    r = await scripts.token_bucket(aclient, key, capacity=1_000, refill=1_000, period_ms=1_000, cost=2_000, slack_ms=0)
    assert (r.allowed, r.remaining, r.retry_after_ms) == (False, 0, -1)
    for fn in (scripts.fixed_window, scripts.sliding_counter):
        r = await fn(aclient, f"rl:v3:{T}:big2", limit=5, window_ms=1_000, cost=6)
        assert r.retry_after_ms == -1
    r = await scripts.sliding_log(aclient, f"rl:v3:{T}:big3", limit=5, window_ms=1_000, member="m", cost=6)
    assert r.retry_after_ms == -1
    assert await aclient.dump(key) == before and await aclient.exists(f"rl:v3:{T}:big2", f"rl:v3:{T}:big3") == 0
    keys, argv = multi_rule_argv(f"rl:v3:{T}:d", [Call(f"rl:v3:{T}:u", "tb", (20_000, 2_000, 1_000, 1_000, 0)),
                                                   Call(key, "tb", (1_000, 1_000, 1_000, 2_000, 0))],
                                 slack_ms=0, decision_ttl_ms=0, member="m")
    r = await scripts.multi_rule(aclient, keys, argv)
    assert (r.allowed, r.denied_by, r.retry_after_ms) == (False, 2, -1)
    assert await aclient.exists(f"rl:v3:{T}:u") == 0


async def test_clock_backwards_and_lowered_capacity(aclient, scripts):
    key = f"rl:v3:{T}:clock"
    future = now_ms() + 60_000
    await aclient.hset(key, mapping={"tokens": 5_000, "ts": future})
    r = await scripts.token_bucket(aclient, key, capacity=20_000, refill=2_000, period_ms=1_000, cost=1_000,
                                   slack_ms=0)
    assert r.remaining == 4_000 and int(await aclient.hget(key, "ts")) == future  # ts never moves back
    await aclient.hset(key, mapping={"tokens": 20_000, "ts": future})
    r = await scripts.token_bucket(aclient, key, capacity=3_000, refill=2_000, period_ms=1_000, cost=1_000,
                                   slack_ms=0)
    assert r.remaining == 2_000  # clamped to the lowered capacity first
    await aclient.hset(key, mapping={"tokens": 0, "ts": 1})  # decades ago: one full refill at most
    r = await scripts.token_bucket(aclient, key, capacity=20_000, refill=2_000, period_ms=1_000, cost=1_000,
                                   slack_ms=0)
    assert r.remaining == 19_000


async def _denials(aclient, scripts):
    """(key, coroutine factory) pairs that must deny."""
    t = now_ms()
    kb, kg, kf, ks, kl, kc = (f"rl:v3:{T}:deny:{n}" for n in ("tb", "gcra", "fw", "sc", "sl", "cc"))
    await aclient.hset(kb, mapping={"tokens": 500, "ts": t + 60_000})
    await aclient.set(kg, t + 10_000, px=60_000)
    await aclient.hset(kf, mapping={"w": t + 60_000, "n": 20})
    await aclient.hset(ks, mapping={"w": t + 60_000, "cur": 20, "prev": 0})
    await aclient.zadd(kl, {f"m{i}": t - 20_000 + i for i in range(5)})  # expired: must NOT be trimmed
    await aclient.zadd(kl, {f"n{i}": t + 60_000 for i in range(20)})
    await aclient.zadd(kc, {"old": t - 5, "a": t + 60_000, "b": t + 60_000})
    for k in (kb, kf, ks, kl, kc):
        await aclient.pexpire(k, 120_000)
    tb = dict(capacity=20_000, refill=2_000, period_ms=1_000, cost=1_000, slack_ms=0)
    return [
        (kb, lambda: scripts.token_bucket(aclient, kb, **tb)),
        (kg, lambda: scripts.gcra(aclient, kg, **tb)),
        (kf, lambda: scripts.fixed_window(aclient, kf, limit=20, window_ms=10_000)),
        (ks, lambda: scripts.sliding_counter(aclient, ks, limit=20, window_ms=10_000)),
        (kl, lambda: scripts.sliding_log(aclient, kl, limit=20, window_ms=10_000, member="new")),
        (kc, lambda: scripts.concurrency_acquire(aclient, kc, "c", max_in_flight=2, slot_ttl_ms=1_000)),
    ]


async def test_denials_write_nothing(aclient, scripts):
    for key, call in await _denials(aclient, scripts):
        before, ttl = await aclient.dump(key), await aclient.pttl(key)
        r = await call()
        assert not getattr(r, "allowed", getattr(r, "ok", True)), key
        assert await aclient.dump(key) == before, key
        assert await aclient.pttl(key) <= ttl, key


async def test_multi_rule_denial_writes_nothing_but_the_record(aclient, scripts):
    t = now_ms()
    pool = f"rl:v3:{T}:pool"
    assert (await scripts.pool_deposit(aclient, pool, "P1", granted=2, valid_from_ms=t - 1_000,
                                       expires_at_ms=t + 60_000, max_entries=4, slack_ms=1_000)).stored
    rules = [Call(f"rl:v3:{T}:m:tb", "tb", (20_000, 2_000, 1_000, 1_000, 0)),
             Call(f"rl:v3:{T}:m:sl", "sl", (5, 10_000, 1, 0, 0)),
             Call(f"rl:v3:{T}:m:cc", "cc", (3, 10_000, 0, 0, 0)),
             Call(pool, "pool", (3, 0, 0, 0, 0))]
    dec = f"rl:v3:{T}:m:dec"
    keys, argv = multi_rule_argv(dec, rules, slack_ms=1_000, decision_ttl_ms=30_000, member="D9")
    before = await aclient.dump(pool)
    r = await scripts.multi_rule(aclient, keys, argv)
    assert r == MultiRuleResult(False, 4, 0, (20_000, 5, 0, 2))
    assert await aclient.exists(*keys[1:4]) == 0 and await aclient.dump(pool) == before
    # a denial by a leased pool is not recorded: once the region's balance is topped up, the agent
    # runs the same decision again and gets a fresh answer (the top-up wait works for idempotent rules too)
    assert await aclient.exists(dec) == 0
    assert (await scripts.pool_deposit(aclient, pool, "P2", granted=7, valid_from_ms=t - 1_000,
                                       expires_at_ms=t + 60_000, max_entries=4, slack_ms=1_000)).stored
    again = await scripts.multi_rule(aclient, keys, argv)
    assert again.allowed and again.remaining[3] == 6
    assert 0 < await aclient.pttl(dec) <= 30_000
    assert await scripts.multi_rule(aclient, keys, argv) == again  # a retry gets the stored answer
    # any other denial is recorded and replayed
    never = [Call(f"rl:v3:{T}:m2:tb", "tb", (1_000, 1, 1_000, 2_000, 0))]
    keys2, argv2 = multi_rule_argv(f"rl:v3:{T}:m2:dec", never, slack_ms=1_000, decision_ttl_ms=30_000, member="D8")
    first = await scripts.multi_rule(aclient, keys2, argv2)
    assert not first.allowed and 0 < await aclient.pttl(keys2[0]) <= 30_000
    assert await scripts.multi_rule(aclient, keys2, argv2) == first


async def _pttl_since(aclient, key: str, t: int) -> tuple[int, int]:
    """The key's PTTL and the ms passed since ``t`` (read after it): a lower bound on a PTTL that was
    ``x`` at ``t`` is ``x - passed`` (a slow machine's seconds are not the script's doing)."""
    ttl = await aclient.pttl(key)
    return ttl, now_ms() - t


async def test_a_debit_never_shortens_the_balance_expiry(aclient, scripts):
    """A deposit keeps the pool hash for its slack past the last lease's end, so the agent can close
    the lease (after its deadline, on a later tick) and find its record. A debit (pool_take or a
    pool rule in multi_rule) passing a smaller slack must not cut that short: the record would be
    gone at the close and the lease reported lost (fully spent) although nothing failed."""
    t = now_ms()
    pool = f"rl:v3:{T}:keep:pool"
    # P1 lasts 4 s (the two debits below must find it valid on a stalled machine), kept 5 s past that
    assert (await scripts.pool_deposit(aclient, pool, "P1", granted=50, valid_from_ms=t - 1, expires_at_ms=t + 4_000,
                                       max_entries=4, slack_ms=5_000)).stored
    took = await scripts.pool_take(aclient, pool, min_tokens=1, want=10, slack_ms=0)
    assert took.taken == 10
    ttl, passed = await _pttl_since(aclient, pool, t)
    assert ttl > 8_000 - passed
    keys, argv = multi_rule_argv(f"rl:v3:{T}:keep:dec", [Call(pool, "pool", (1, 0, 0, 0, 0))], slack_ms=0,
                                 decision_ttl_ms=1_000, member="K1")
    assert (await scripts.multi_rule(aclient, keys, argv)).allowed
    ttl, passed = await _pttl_since(aclient, pool, t)
    assert ttl > 8_000 - passed
    # a later lease still extends it
    assert (await scripts.pool_deposit(aclient, pool, "P2", granted=5, valid_from_ms=t - 1, expires_at_ms=t + 20_000,
                                       max_entries=4, slack_ms=0)).stored
    ttl, passed = await _pttl_since(aclient, pool, t)
    assert 18_000 - passed < ttl <= 20_000
    await scripts.pool_take(aclient, pool, min_tokens=1, want=1, slack_ms=1_000)
    ttl, passed = await _pttl_since(aclient, pool, t)
    assert 19_000 - passed < ttl <= 21_000


async def test_every_written_key_has_an_expiry(aclient, scripts):
    t = now_ms()
    pool = f"rl:v3:{T}:ttl:pool"
    d = await scripts.pool_deposit(aclient, pool, "P1", granted=10, valid_from_ms=t - 1, expires_at_ms=t + 30_000,
                                   max_entries=4, slack_ms=1_000)
    ttl, passed = await _pttl_since(aclient, pool, t)
    assert d.stored and 29_000 - passed < ttl <= 31_000
    rules = [Call(f"rl:v3:{T}:ttl:tb", "tb", (20_000, 2_000, 1_000, 1_000, 0)),
             Call(f"rl:v3:{T}:ttl:gcra", "gcra", (20_000, 2_000, 1_000, 1_000, 0)),
             Call(f"rl:v3:{T}:ttl:fw", "fw", (20, 10_000, 1, 0, 0)),
             Call(f"rl:v3:{T}:ttl:sc", "sc", (20, 10_000, 1, 0, 0)),
             Call(f"rl:v3:{T}:ttl:sl", "sl", (20, 10_000, 2, 0, 0)),
             Call(f"rl:v3:{T}:ttl:cc", "cc", (3, 10_000, 0, 0, 0)),
             Call(pool, "pool", (4, 0, 0, 0, 0))]
    keys, argv = multi_rule_argv(f"rl:v3:{T}:ttl:dec", rules, slack_ms=500, decision_ttl_ms=5_000, member="D1")
    r = await scripts.multi_rule(aclient, keys, argv)
    assert r.allowed and r.remaining[-1] == 6 and r.remaining[4] == 18 and r.remaining[5] == 1
    for k in keys:
        assert await aclient.pttl(k) > 0, k
    singles = [
        scripts.token_bucket(aclient, f"rl:v3:{T}:s:tb", capacity=1_000, refill=1, period_ms=1, cost=1, slack_ms=0),
        scripts.gcra(aclient, f"rl:v3:{T}:s:g", capacity=1_000, refill=1, period_ms=1, cost=1, slack_ms=5_000),
        scripts.fixed_window(aclient, f"rl:v3:{T}:s:fw", limit=2, window_ms=60_000),
        scripts.sliding_counter(aclient, f"rl:v3:{T}:s:sc", limit=2, window_ms=60_000),
        scripts.sliding_log(aclient, f"rl:v3:{T}:s:sl", limit=2, window_ms=60_000, member="x"),
        scripts.concurrency_acquire(aclient, f"rl:v3:{T}:s:cc", "x", max_in_flight=2, slot_ttl_ms=60_000),
    ]
    for coro in singles:
        await coro
    for k in ("tb", "g", "fw", "sc", "sl", "cc"):
        assert await aclient.pttl(f"rl:v3:{T}:s:{k}") > 0, k
    assert (await scripts.concurrency_renew(aclient, f"rl:v3:{T}:s:cc", "x", slot_ttl_ms=90_000)).ok
    assert 60_000 < await aclient.pttl(f"rl:v3:{T}:s:cc") <= 90_000


async def test_wrong_key_type_fails_before_any_write(aclient, scripts):
    """Every rule's check reads its key before any commit, so a key of the wrong type makes the
    whole call fail with nothing written."""
    good, bad = f"rl:v3:{T}:wt:ok", f"rl:v3:{T}:wt:bad"
    await aclient.set(bad, "not a hash")
    keys, argv = multi_rule_argv(f"rl:v3:{T}:wt:d", [Call(good, "tb", (20_000, 2_000, 1_000, 1_000, 0)),
                                                      Call(bad, "fw", (20, 10_000, 1, 0, 0))],
                                 slack_ms=0, decision_ttl_ms=5_000, member="m")
    with pytest.raises(ScriptRejected):
        await scripts.multi_rule(aclient, keys, argv)
    assert await aclient.exists(good, f"rl:v3:{T}:wt:d") == 0 and await aclient.get(bad) == b"not a hash"


async def test_a_lean_variant_refuses_a_kind_it_does_not_have_before_any_write(aclient, scripts):
    """``multi_rule[tb]`` has only the token bucket's library: a call with a fixed-window slot is
    refused as an unknown kind is, and nothing is written — the full script would have run it."""
    keys = [f"rl:v3:{T}:d:lean", f"rl:v3:{T}:lean:tb", f"rl:v3:{T}:lean:fw"]
    argv = ["100", "5000", "D1", "tb", "20000", "2000", "1000", "1000", "0", "fw", "10", "1000", "1", "0", "0", "q1"]
    with pytest.raises(ScriptRejected):
        await scripts.call(aclient, "multi_rule[tb]", keys, argv)
    assert await aclient.exists(*keys) == 0
    assert (await scripts.call(aclient, "multi_rule[fw,tb]", keys, argv))[0] == 1  # its own variant runs it


# per kind: a valid slot's five parameters, and which of them the kind reads (the rest are ignored)
SLOTS = {
    "tb": (["20000", "2000", "1000", "1000", "0"], 4), "gcra": (["20000", "2000", "1000", "1000", "0"], 4),
    "fw": (["20", "10000", "1", "0", "0"], 3), "sc": (["20", "10000", "1", "0", "0"], 3),
    "sl": (["20", "10000", "1", "0", "0"], 3), "cc": (["3", "60000", "0", "0", "0"], 2),
    "pool": (["5", "0", "0", "0", "0"], 1), "pw": (["10", "3", "4", "1", "60000"], 5),
}


@pytest.mark.parametrize(("kind", "position"), [(k, p) for k in SLOTS for p in range(5)])
async def test_multi_rule_reads_each_kinds_parameters_at_the_rules_offset(aclient, scripts, kind, position):
    """A rule after another one (its parameters at an offset in ARGV): a bad value in a parameter its
    kind reads is refused before any write; in one it does not read (always 0 from the agent), it is
    ignored."""
    params, used = SLOTS[kind]
    tag = "{t:off-" + kind + str(position) + "}"
    keys = [f"rl:v3:{tag}:d", f"rl:v3:{tag}:first", f"rl:v3:{tag}:second"]
    bad = list(params)
    bad[position] = "abc"
    argv = ["0", "0", "D1", "tb", "20000", "2000", "1000", "1000", "0", kind, *bad, ""]
    if position < used:
        with pytest.raises(ScriptRejected):
            await scripts.call(aclient, "multi_rule", keys, argv)
        assert await aclient.exists(*keys) == 0
    else:
        reply = await scripts.call(aclient, "multi_rule", keys, argv)
        assert isinstance(reply, list) and len(reply) == 5
