"""The worked numbers of docs/invariants.md through the real scripts (standalone and cluster).

Exactness without a caller clock: a stored timestamp in the future means "no time has passed"
(the scripts never refill on a backwards clock), and where elapsed time matters the state is
written relative to the clock just before the call and the call is repeated until it lands in the
same millisecond (a denial writes nothing, so repeating it is harmless); every other attempt must
still match the reference model for some instant inside its bracket."""

from __future__ import annotations

import asyncio

import pytest

from kernel.algorithms import gcra as gcra_model
from kernel.algorithms import sliding_counter
from kernel.algorithms import token_bucket as tb_model
from kernel.algorithms.fixed_window import WindowParams
from kernel.algorithms.gcra import GcraState
from kernel.algorithms.sliding_counter import SlidingCounterState
from kernel.algorithms.token_bucket import TokenBucketParams, TokenBucketState
from region_agent.decision.call import Call, MultiRuleResult, multi_rule_argv

from .support import now_ms

pytestmark = pytest.mark.integration

P_READ = dict(capacity=20_000, refill=2_000, period_ms=1_000, cost=1_000, slack_ms=5_000)
FUTURE = 3_600_000
KEY = "rl:v3:{t:atlas}:u:9f2c41ab:read"


async def exact_or_model(call, setup, expected, model, attempts: int = 50) -> int:
    """Repeat (setup, call) until the reply equals ``expected``; every reply must equal
    ``model(t, now)`` (t: the clock the setup wrote its state against) for some now in its bracket.
    Returns the t of the attempt that hit ``expected``."""
    seen = []
    for _ in range(attempts):
        t0 = await setup()
        got = await call()
        t1 = now_ms()
        assert any(model(t0, n) == got for n in range(t0, t1 + 1)), (got, t0, t1)
        seen.append(got)
        if got == expected:
            return t0
    pytest.fail(f"never hit the same millisecond: {seen[-3:]}")


async def test_p_read_timeline(aclient, scripts):
    await aclient.hset(KEY, mapping={"tokens": 20_000, "ts": now_ms() + FUTURE})
    replies = [await scripts.token_bucket(aclient, KEY, **P_READ) for _ in range(21)]
    assert [r.remaining for r in replies[:20]] == list(range(19_000, -1, -1_000))
    assert all(r.allowed for r in replies[:20])
    assert (replies[20].allowed, replies[20].remaining, replies[20].retry_after_ms) == (False, 0, 500)
    assert 0 < await aclient.pttl(KEY) <= 15_000

    p = TokenBucketParams(20_000, 2_000, 1_000, 1_000)

    def at(offset, tokens=0):
        async def setup():
            t = now_ms()
            await aclient.hset(KEY, mapping={"tokens": tokens, "ts": t - offset})
            return t
        return setup

    async def call():
        r = await scripts.token_bucket(aclient, KEY, **P_READ)
        return [int(r.allowed), r.remaining, r.retry_after_ms]

    def model(offset, tokens=0):
        return lambda t, n: tb_model.decide(TokenBucketState(tokens, t - offset), p, n)[0].as_reply()

    await exact_or_model(call, at(300), [0, 600, 200], model(300))
    # after 5 s idle: 10 tokens, the first of 10 allowed requests leaves 9,000
    await exact_or_model(call, at(5_000), [1, 9_000, 0], model(5_000))
    # after 10 s (or far more) idle the bucket is capped at 20
    await exact_or_model(call, at(10_000), [1, 19_000, 0], model(10_000))
    await exact_or_model(call, at(500_000), [1, 19_000, 0], model(500_000))


async def test_weighted_export_retry(aclient, scripts):
    key = "rl:v3:{t:atlas}:k:1:export"
    await aclient.hset(key, mapping={"tokens": 3_000, "ts": now_ms() + FUTURE})
    before = await aclient.dump(key)
    r = await scripts.token_bucket(aclient, key, capacity=20_000, refill=2_000, period_ms=1_000, cost=10_000,
                                   slack_ms=5_000)
    assert (r.allowed, r.remaining, r.retry_after_ms) == (False, 3_000, 3_500)
    assert await aclient.dump(key) == before


async def test_multi_rule_walkthrough(aclient, scripts):
    user, tenant, dec = "rl:v3:{t:atlas}:u:U-17:read", "rl:v3:{t:atlas}:tenant:atlas:all", "rl:v3:{t:atlas}:d:1"
    future = now_ms() + FUTURE

    def rules(cost):
        return [Call(user, "tb", (20_000, 2_000, 1_000, cost, 0)),
                Call(tenant, "tb", (1_000_000, 1_000_000, 60_000, cost, 0))]

    async def run(cost, member):
        keys, argv = multi_rule_argv(dec + member, rules(cost), slack_ms=5_000, decision_ttl_ms=0, member=member)
        return await scripts.multi_rule(aclient, keys, argv)

    await aclient.hset(user, mapping={"tokens": 1_000, "ts": future})
    await aclient.hset(tenant, mapping={"tokens": 639_000, "ts": future})
    assert await run(1_000, "a") == MultiRuleResult(True, 0, 0, (0, 638_000))
    assert 0 < await aclient.pttl(user) <= 15_000 and 60_000 < await aclient.pttl(tenant) <= 65_000

    await aclient.hset(tenant, mapping={"tokens": 639_000, "ts": future})
    before = await aclient.dump(tenant)
    assert await run(1_000, "b") == MultiRuleResult(False, 1, 500, (0, 639_000))
    assert await aclient.dump(tenant) == before

    await aclient.hset(user, mapping={"tokens": 20_000, "ts": future})
    await aclient.hset(tenant, mapping={"tokens": 3_000, "ts": future})
    before = await aclient.dump(user)
    r = await run(10_000, "c")
    assert (r.allowed, r.denied_by, r.retry_after_ms, r.remaining) == (False, 2, 420, (20_000, 3_000))
    assert await aclient.dump(user) == before


async def away_from_boundary(window_ms: int, margin_ms: int) -> int:
    """Wait (at most margin_ms) so the next margin_ms stay inside one window; returns its start."""
    left = window_ms - now_ms() % window_ms
    if left < margin_ms:
        await asyncio.sleep((left + 2) / 1000)
    t = now_ms()
    return t - t % window_ms


async def test_fixed_window_boundary(aclient, scripts):
    key = "rl:v3:{t:atlas}:ip:1:anon"
    w = 10_000
    for _ in range(3):  # a scenario that straddled a window boundary (a stalled machine) is re-run
        start = await away_from_boundary(w, 500)
        await aclient.hset(key, mapping={"w": start, "n": 20})
        before = await aclient.dump(key)
        t0 = now_ms()
        r = await scripts.fixed_window(aclient, key, limit=20, window_ms=w, slack_ms=2_000)
        t1 = now_ms()
        after = await aclient.dump(key)
        # in the next window the stale w restarts the count: 20 more are admitted, the 21st is not
        await aclient.hset(key, mapping={"w": start - w, "n": 20})
        got = [await scripts.fixed_window(aclient, key, limit=20, window_ms=w, slack_ms=2_000) for _ in range(21)]
        if now_ms() - start < w:
            break
    # the 21st in the window: {0, 0, ms left} (100 at 9,900 ms into it), nothing written
    assert (r.allowed, r.remaining) == (False, 0)
    assert start + w - t1 <= r.retry_after_ms <= start + w - t0
    assert after == before
    assert [g.allowed for g in got] == [True] * 20 + [False]
    assert [g.remaining for g in got[:20]] == list(range(19, -1, -1))
    assert 0 < await aclient.pttl(key) <= w + 2_000


async def test_sliding_log_retry_hint(aclient, scripts):
    key = "rl:v3:{t:atlas}:u:1:audit"

    async def setup():
        t = now_ms()
        await aclient.delete(key)
        await aclient.zadd(key, {f"r{i}": t for i in range(20)})
        return t

    async def call():
        r = await scripts.sliding_log(aclient, key, limit=20, window_ms=10_000, member="r21")
        return [int(r.allowed), r.remaining, r.retry_after_ms]

    async def scored():
        return int((await aclient.zrange(key, 0, 0, withscores=True))[0][1])

    # the hint is the oldest entry's age subtracted from the window, read on the store's clock:
    # 10,000 ms when the call lands in the millisecond the entries were written, less by exactly
    # the milliseconds that passed (bracketed by the caller's clock before and after the call;
    # a loaded machine or a cluster hop rarely lands in the same millisecond, so no exact wait)
    for _ in range(5):
        await setup()
        admitted_at = await scored()
        t0 = now_ms()
        got = await call()
        t1 = now_ms()
        assert got[:2] == [0, 0] and admitted_at + 10_000 - t1 <= got[2] <= admitted_at + 10_000 - t0, \
            (got, admitted_at, t0, t1)
    assert await aclient.zcard(key) == 20  # the denial added nothing
    r = await scripts.sliding_log(aclient, key, limit=20, window_ms=10_000, member="r3")
    assert r.allowed and await aclient.zcard(key) == 20  # a replay adds no second entry


async def test_sliding_counter_seed_case(aclient, scripts):
    """The sliding window counter's worked case scaled down 10x in time (W = 1 s, elapsed >= 250 ms): prev 18, cur 5 ->
    18 x 750 + 5 x 1,000 + 1,000 = 19,500 <= 20,000 at 250 ms: allowed."""
    key = "rl:v3:{t:atlas}:u:1:sc"
    w = 1_000
    for _ in range(3):  # re-run if a stalled machine pushed the call past the window end
        t = now_ms()
        if not 250 <= t % w <= 800:
            await asyncio.sleep(((250 - t % w) % w + 5) / 1000)
        t0 = now_ms()
        start = t0 - t0 % w
        if t0 - start < 250:  # the sleep overshot into the next window's first quarter: elapsed < 250 ms
            t1 = start + w
            continue
        await aclient.hset(key, mapping={"w": start, "cur": 5, "prev": 18})
        r = await scripts.sliding_counter(aclient, key, limit=20, window_ms=w, slack_ms=0)
        t1 = now_ms()
        if t1 - start < w:
            break
    assert 250 <= t0 - start and t1 - start < w, "every attempt crossed the window boundary"
    expected = [sliding_counter.decide(SlidingCounterState(start, 5, 18), WindowParams(20, w), n)[0]
                for n in range(t0, t1 + 1)]
    assert r.allowed and any((r.remaining, r.retry_after_ms) == (d.remaining, d.retry_after_ms) for d in expected)
    assert await aclient.hmget(key, "cur", "prev") == [b"6", b"18"]
    # clock-independent: a stored window in the future is the current one, elapsed 0
    await aclient.hset(key, mapping={"w": start + 5 * w, "cur": 1, "prev": 18})
    r = await scripts.sliding_counter(aclient, key, limit=20, window_ms=w)
    assert (r.allowed, r.remaining) == (True, 0)  # 18,000 + 1,000 + 1,000 = 20,000 <= 20,000
    before = await aclient.dump(key)
    t0 = now_ms()
    r = await scripts.sliding_counter(aclient, key, limit=20, window_ms=w)
    t1 = now_ms()
    # denied (cur is 2 now): prev (18) must decay by 1,000 scaled units: ceil(1,000/18) = 56 ms into w
    assert not r.allowed and start + 5 * w + 56 - t1 <= r.retry_after_ms <= start + 5 * w + 56 - t0
    assert await aclient.dump(key) == before


async def test_gcra_worked_numbers(aclient, scripts):
    key = "rl:v3:{t:atlas}:u:1:gcra"
    args = dict(P_READ)
    p = TokenBucketParams(20_000, 2_000, 1_000, 1_000)

    def at(ahead):
        async def setup():
            t = now_ms()
            await aclient.set(key, t + ahead)
            return t
        return setup

    async def call():
        r = await scripts.gcra(aclient, key, **args)
        return [int(r.allowed), r.remaining, r.retry_after_ms]

    def model(ahead):
        return lambda t, n: gcra_model.decide(GcraState(t + ahead), p, n)[0].as_reply()

    await exact_or_model(call, at(10_000), [0, 0, 500], model(10_000))  # the 21st request
    t0 = await exact_or_model(call, at(5_000), [1, 9_000, 0], model(5_000))  # 5 s later: 5,500 ahead
    # the stored TAT is the setup's clock + 5,000 + one 500 ms increment (measured against the clock
    # of the setup, not read back later: a stalled machine would make "ahead" smaller)
    assert int(await aclient.get(key)) == t0 + 5_500
    assert 0 < await aclient.pttl(key) <= 5_500 + 5_000


async def test_concurrency_fourth_export_denied(aclient, scripts):
    key = "rl:v3:{t:birch}:tenant:birch:export:cc"
    for i in range(3):
        r = await scripts.concurrency_acquire(aclient, key, f"E{i}", max_in_flight=3, slot_ttl_ms=60_000)
        assert (r.ok, r.in_flight) == (True, i + 1)
    before = await aclient.dump(key)
    r = await scripts.concurrency_acquire(aclient, key, "E3", max_in_flight=3, slot_ttl_ms=60_000)
    assert (r.ok, r.in_flight) == (False, 3) and await aclient.dump(key) == before
    r = await scripts.concurrency_acquire(aclient, key, "E1", max_in_flight=3, slot_ttl_ms=60_000)
    assert (r.ok, r.in_flight) == (True, 3)
    r = await scripts.concurrency_release(aclient, key, "E0")
    assert (r.ok, r.in_flight) == (True, 2)
    r = await scripts.concurrency_release(aclient, key, "E0")
    assert (r.ok, r.in_flight) == (False, 2)
    r = await scripts.concurrency_renew(aclient, key, "E1", slot_ttl_ms=120_000)
    assert (r.ok, r.in_flight) == (True, 2) and 60_000 < await aclient.pttl(key) <= 120_000
    r = await scripts.concurrency_renew(aclient, key, "E0", slot_ttl_ms=120_000)
    assert (r.ok, r.in_flight) == (False, 2)
