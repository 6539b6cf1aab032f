"""region_agent.leasing.fleet_pools: one request's spend of a fleet-wide pool - chunk, renewal,
take-alone, fallback allowance, in-process allowance - with a store that answers what each test
scripts, a manual clock and an in-process lease manager view (no network; the Redis scripts are
exercised by tests/integration/leases and tests/integration/region_agent)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from kernel.algorithms.pool_window import MAX_SPAN
from kernel.bundle import load_bundle_file
from kernel.errors import Overloaded, ScriptRejected, StoreUnavailable
from region_agent.decision.fallback import LocalAllowances
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import GlobalSpend
from region_agent.leasing.book import BalanceState
from region_agent.leasing.chunks import NO_CHUNK, Chunk
from region_agent.leasing.fleet_pools import LATE_PARTS, RENEWALS_PER_REQUEST, FleetPools, TakeStatus
from region_agent.leasing.redis_balance import BALANCE_SLACK_MS
from region_agent.leasing.topup import ROLLOVER_WAIT_MS, ROLLOVER_WAITS, until_start_s
from region_agent.leasing.window_clock import Windows
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock
from tests.support.scripted_store import ScriptedStore as Store

GLOBAL = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))
RULE = next(r for r in GLOBAL.rules if r.scope == "global")  # global-catalog, local_bounded
POOL = next(p for p in GLOBAL.pools if p.id == RULE.pool)  # global-read: chunkMax 2000, fallback 4000
GKEY = KeyBuilder.global_pool_key(POOL.id)
WINDOWS = Windows(lo=5, hi=5, end_in_ms=400, safe_ms=300)
#: A request's budget (``take``'s deadline is ``c.t + BUDGET_S``). The fake clock moves only when a
#: test moves it, but the waits it bounds are real (``asyncio.wait_for`` on the loop's clock): so it
#: is long enough that no stall of a busy machine ends one. No test here waits it out; a budget
#: already spent is the clock's own reading (``f.take(spend(), c.t, c)``).
BUDGET_S = 30.0


class Leases:
    """What FleetPools asks of the lease manager."""

    def __init__(self, state: BalanceState = BalanceState.OK, pending: asyncio.Future | None = None, hint: int = 40):
        self.balance_state = state
        self.in_flight = pending
        self.hint = hint
        self.noted: list[int] = []

    def note(self, pool, key, tokens):
        assert key == GKEY
        self.noted.append(tokens)

    def observed(self, key, spendable):
        return self.in_flight

    def state(self, key):
        return self.balance_state

    def retry_hint_ms(self, key):
        return self.hint


def fleet(store: Store, leases: Leases | None = None, clock: FakeClock | None = None,
          windows: Windows = WINDOWS, hold_ms: int | None = None) -> tuple[FleetPools, FakeClock, AgentMetrics]:
    c = clock or FakeClock(10.0)
    m = AgentMetrics()
    f = FleetPools(store=store, metrics=m, leases=leases, now_ms=lambda: c.t * 1000.0,
                   windows=lambda pool: windows, allowance=LocalAllowances(), budget_s=0.05, hold_ms=hold_ms)
    return f, c, m


def spend(cost: int = 1, **rule_changes) -> GlobalSpend:
    rule = msgspec.structs.replace(RULE, **rule_changes) if rule_changes else RULE
    return GlobalSpend(rule, POOL, cost)


def sample(m: AgentMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


TAKEN_ALL = [[2000, 5000, 250, 0]]  # pool_take: taken, remaining, valid for, next from
EMPTY = [[0, 0, 0, 0]]


# ------------------------------------------------------------------------------- chunks
async def test_a_chunk_is_bought_once_then_spent_locally():
    store = Store(TAKEN_ALL)
    leases = Leases()
    f, c, m = fleet(store, leases)
    first = await f.take(spend(), c.t + BUDGET_S, c)
    assert first.status is TakeStatus.OK and not first.fallback
    [[(script, keys, argv)]] = store.sent
    # at least 1, as many as this agent's demand calls for (one request so far: 1), up to chunkMax,
    # at most 4 per second of validity (1 token over 250 ms) but never fewer than the one request
    # waiting for it; a debit never shortens the balance hash's expiry (slack)
    assert (script, keys, argv) == ("pool_take", [GKEY], [1, 1, BALANCE_SLACK_MS, 4, 1])
    for _ in range(5):
        assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
    assert len(store.sent) == 1 and f.remaining(POOL.id) == 2000 - 6
    assert leases.noted == [1] * 6  # demand is what requests ask for, not what chunks buy
    assert sample(m, "leasehold_agent_pool_renewals_total", pool=POOL.id, outcome="granted") == 1


async def test_chunks_are_sized_by_what_this_agent_is_asked():
    """A renewal buys a quarter of what this agent's requests asked of the pool over the last
    chunk validity (net of give-backs), at least what the requests waiting for it need, at most
    chunkMax: a chunk's unspent rest expires with it, so a chunk of chunkMax at an agent asked a
    few tokens per validity would be wasted."""
    store = Store(*([[[1, 5000, 250, 0]]] * 40))
    f, c, _ = fleet(store, Leases())
    for _ in range(40):  # 40 requests over 200 ms, each renewing the 1-token chunk the last one bought
        assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
        c.t += 0.005
    wants = [argv[1] for [(_s, _k, argv)] in store.sent]
    # the last renewal: what the last quarter validity (62.5 ms, ~12 requests) asked, or a quarter of
    # the 40 asked over the validity, whichever is more
    assert wants[0] == 1 and 10 <= wants[-1] <= 14
    assert store.sent[-1][0][2][3] == -(-wants[-1] * 1000 // 250)  # per second of the 250 ms validity
    c.t += 0.3  # more than one validity of silence: the demand is forgotten
    store.answers.append([[1, 5000, 250, 0]])
    await f.take(spend(), c.t + BUDGET_S, c)
    assert store.sent[-1][0][2][1] in (1, 2)


async def test_waiting_requests_get_a_chunk_for_all_of_them():
    store = Store([[12, 5000, 250, 0]])
    store.gate = asyncio.Event()
    f, c, _ = fleet(store, Leases())
    tasks = [asyncio.ensure_future(f.take(spend(), c.t + BUDGET_S, c)) for _ in range(12)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    store.gate.set()
    assert [t.status for t in await asyncio.gather(*tasks)] == [TakeStatus.OK] * 12
    assert store.sent[0][0][2][1] == 12 and len(store.sent) == 1  # one renewal paid every waiting request
    # however soon the lease it is bought from ends: the per-second cap never goes below them
    assert store.sent[0][0][2][4] == 12


async def test_a_give_back_lands_only_in_the_chunk_it_came_from():
    store = Store(TAKEN_ALL, TAKEN_ALL)
    f, c, _ = fleet(store, Leases())
    took = await f.take(spend(), c.t + BUDGET_S, c)
    f.give_back(spend(), took.generation)
    assert f.remaining(POOL.id) == 2000
    c.t += 0.25  # the chunk's validity (chunkValidityMs) is over: the next request buys a new one
    again = await f.take(spend(), c.t + BUDGET_S, c)
    assert again.generation == took.generation + 1
    f.give_back(spend(), took.generation)  # late: the old chunk is gone
    assert f.remaining(POOL.id) == 1999
    f.give_back(spend(), NO_CHUNK)  # bought alone: never returned to a chunk
    assert f.remaining(POOL.id) == 1999
    assert f.chunks[POOL.id].take_abandoned() == 2  # both bought and never admitted: abandoned


async def test_a_reservation_given_back_after_the_next_renewal_is_not_lost():
    """A request reserves the chunk's last token and waits for its tenant script; another request
    meanwhile finds the chunk empty and renews it. When the first request is denied by its tenant
    rule, its token lands in its own part, spendable by the next request: it was debited from the
    regional balance (its lease reports it spent), so lost there it is lost to the whole window."""
    store = Store([[1, 5000, 250, 0]], [[2, 5000, 250, 0]])
    f, c, m = fleet(store, Leases())
    out = await f.take(spend(), c.t + BUDGET_S, c)  # the chunk's only token, out on a reservation
    assert out.status is TakeStatus.OK and f.remaining(POOL.id) == 0
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK  # renews: 2 bought, 1 left
    f.give_back(spend(), out.generation)  # the first request was denied by its tenant rule
    assert f.remaining(POOL.id) == 2 and len(store.sent) == 2
    assert [(await f.take(spend(), c.t + BUDGET_S, c)).status for _ in range(2)] == [TakeStatus.OK] * 2
    assert len(store.sent) == 2  # both paid by the chunk: the given-back token was not lost
    assert sample(m, "leasehold_agent_chunk_abandoned_tokens_total", pool=POOL.id) == 0


async def test_concurrent_requests_share_one_renewal():
    store = Store(TAKEN_ALL)
    store.gate = asyncio.Event()
    f, c, m = fleet(store, Leases())
    tasks = [asyncio.ensure_future(f.take(spend(), c.t + BUDGET_S, c)) for _ in range(3)]
    await asyncio.sleep(0)
    store.gate.set()
    takes = await asyncio.gather(*tasks)
    assert [t.status for t in takes] == [TakeStatus.OK] * 3
    assert len(store.sent) == 1 and f.remaining(POOL.id) == 1997
    assert sample(m, "leasehold_agent_pool_waits_total", pool=POOL.id) == 2


async def test_a_partial_chunk_is_all_the_balance_had():
    store = Store([[300, 0, 100, 0]])
    f, c, m = fleet(store, Leases())
    f.chunks[POOL.id] = Chunk()
    f.chunks[POOL.id].ask(3_999, c.t * 1000, POOL.chunk_validity_ms)  # this agent was asked 4,000 tokens
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
    assert store.sent[0][0][2][1] == POOL.chunk_max  # all of them at once: chunkMax; the balance had 300
    assert f.remaining(POOL.id) == 299
    assert sample(m, "leasehold_agent_pool_renewals_total", pool=POOL.id, outcome="partial") == 1
    c.t += 0.1  # validity is the leases' (100 ms), shorter than chunkValidityMs
    store.answers.append(EMPTY)
    await f.take(spend(), c.t + BUDGET_S, c)
    assert len(store.sent) == 2


# ------------------------------------------------------------------------------- denials
async def test_an_exhausted_pool_denies_and_the_denial_is_held_locally():
    store = Store([[0, 0, 0, 120]])  # nothing spendable; the next lease becomes valid in 120 ms
    leases = Leases(BalanceState.EXHAUSTED, hint=90)
    f, c, m = fleet(store, leases)
    d = await f.take(spend(), c.t + BUDGET_S, c)
    assert (d.status, d.retry_ms, d.fallback) == (TakeStatus.DENIED, 120, False)
    c.t += 0.05
    again = await f.take(spend(), c.t + BUDGET_S, c)
    assert (again.status, again.retry_ms) == (TakeStatus.DENIED, 70)  # the rest of the local denial
    assert len(store.sent) == 1  # the denial held: no store call
    assert sample(m, "leasehold_agent_pool_renewals_total", pool=POOL.id, outcome="denied") == 1


async def test_an_exhausted_pools_denial_is_held_no_longer_than_the_hold_then_asked_again():
    """A pool's hint is not exact: tokens an ended lease returned may be leased again before it.
    The local denial is held at most ``hold_ms``; the next request asks the balance again (one
    renewal) and is admitted from the tokens that came back. Until then, answers keep the pool's
    own hint."""
    store = Store([[0, 0, 0, 0]], TAKEN_ALL)  # exhausted; later: tokens came back
    leases = Leases(BalanceState.EXHAUSTED, hint=900)
    f, c, m = fleet(store, leases, hold_ms=100)
    d = await f.take(spend(), c.t + BUDGET_S, c)
    assert (d.status, d.retry_ms) == (TakeStatus.DENIED, 250)  # min(the hint, the validity)
    c.t += 0.06
    held = await f.take(spend(), c.t + BUDGET_S, c)
    assert (held.status, held.retry_ms) == (TakeStatus.DENIED, 190)  # the pool's hint, not the hold's
    assert len(store.sent) == 1
    c.t += 0.05  # the hold (100 ms) is over, the hint (250 ms) is not
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
    assert len(store.sent) == 2


async def test_a_lease_this_agent_deposits_lifts_the_hold_at_once():
    """Tokens an ended lease returned, leased again by this agent's lease manager: its chunk asks
    the balance at the next request instead of denying out the hold."""
    store = Store([[0, 0, 0, 0]], TAKEN_ALL)  # exhausted; then the deposit's tokens
    leases = Leases(BalanceState.EXHAUSTED, hint=900)
    f, c, m = fleet(store, leases, hold_ms=250)
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.DENIED
    c.t += 0.01
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.DENIED  # held
    assert len(store.sent) == 1
    f.refilled("another-pool")  # another pool's deposit changes nothing
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.DENIED
    f.refilled(POOL.id)
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
    assert len(store.sent) == 2


async def test_a_lease_valid_in_a_moment_is_waited_for_at_a_rollover():
    # nothing spendable now, but a deposited lease (the next window's) starts in 30 ms: the renewal
    # waits for it and buys the chunk from it instead of denying until then
    store = Store([[0, 0, 0, 30]], TAKEN_ALL)
    f, c, _ = fleet(store, Leases())
    took = await f.take(spend(), c.t + 1.0, c)
    assert took.status is TakeStatus.OK and len(store.sent) == 2
    assert f.remaining(POOL.id) == 1_999
    assert (await f.take(spend(), c.t + 1.0, c)).status is TakeStatus.OK  # paid by the chunk
    assert len(store.sent) == 2


async def test_a_lease_starting_later_than_the_rollover_wait_is_a_denial_with_its_start_as_the_hint():
    store = Store([[0, 0, 0, ROLLOVER_WAIT_MS + 100]])
    f, c, _ = fleet(store, Leases(hint=1))
    took = await f.take(spend(), c.t + 1.0, c)
    assert (took.status, took.retry_ms) == (TakeStatus.DENIED, ROLLOVER_WAIT_MS + 100)
    assert len(store.sent) == 1


async def test_a_lease_start_is_waited_for_one_ms_longer_than_the_store_said():
    # the store's clock is floored to the ms and a loop timer may end up to 1 ms early (uvloop)
    store = Store([[0, 0, 0, 20]], TAKEN_ALL)
    f, c, _ = fleet(store, Leases())
    loop = asyncio.get_running_loop()
    started = loop.time()
    took = await f.take(spend(), c.t + 1.0, c)
    assert took.status is TakeStatus.OK and loop.time() - started >= until_start_s(20) == 0.021


async def test_a_lease_start_still_ahead_after_the_wait_is_waited_for_again():
    # the timer ended a moment before the store's clock reached the start ("1 ms" more): the
    # request that waited is paid from that lease, not denied for a millisecond
    store = Store([[0, 0, 0, 20]], [[0, 0, 0, 1]], TAKEN_ALL)
    f, c, _ = fleet(store, Leases(hint=1))
    took = await f.take(spend(), c.t + 1.0, c)
    assert took.status is TakeStatus.OK and len(store.sent) == 3


async def test_the_rollover_waits_are_bounded():
    # a start that stays ahead (a store clock that does not advance): denied after ROLLOVER_WAITS
    # waits, with the start as the hint
    store = Store(*[[[0, 0, 0, 20]]] * (ROLLOVER_WAITS + 2))
    f, c, _ = fleet(store, Leases(hint=1))
    took = await f.take(spend(), c.t + 1.0, c)
    assert (took.status, took.retry_ms) == (TakeStatus.DENIED, 20) and len(store.sent) == ROLLOVER_WAITS + 1


class SlowStore(Store):
    """Its first answer (``every``: each) arrives ``delay_s`` after it was asked (the clock moves
    by it); a refund is answered as given back in full, whenever it comes."""

    def __init__(self, clock: FakeClock, delay_s: float, *answers, every: bool = False):
        super().__init__(*answers)
        self.clock, self.delay_s, self.every = clock, delay_s, every
        self.refunds: list[list] = []
        self.refunded = asyncio.Event()

    async def submit(self, calls, *, wait_s):
        if calls[0][0] == "pool_refund":
            self.refunds.append(calls[0][2])
            self.refunded.set()
            return [[calls[0][2][0], b"refunded"]]
        if self.every or not self.sent:
            self.clock.t += self.delay_s
        return await super().submit(calls, wait_s=wait_s)


async def test_a_part_that_ended_before_it_arrived_is_bought_again_and_its_rest_refunded():
    # bought in a lease's last 2 ms, the reply 3 ms later: the request is paid by the next lease's
    # chunk (not denied as busy); the late part's 5 tokens go back to the lease they came from
    c = FakeClock(10.0)
    store = SlowStore(c, 0.003, [[5, 10, 2, 0, [b"L1", 5]]], TAKEN_FROM_TWO)
    f, _, m = fleet(store, Leases(), clock=c)
    took = await f.take(spend(), c.t + 1.0, c)
    assert took.status is TakeStatus.OK and len(store.sent) == 2 and f.remaining(POOL.id) == 1_999
    await asyncio.wait_for(store.refunded.wait(), 1.0)  # the late part is due at once (its timer's delay is 0)
    await asyncio.gather(*f._refunding)
    assert store.refunds == [[5, BALANCE_SLACK_MS, "L1", 5]]
    assert sample(m, "leasehold_agent_chunk_refunded_tokens_total", pool=POOL.id) == 5


async def test_a_part_bought_late_is_bought_again_a_bounded_number_of_times():
    # every reply later than the part it brings (a store slower than what it sells): each renewal
    # asks LATE_PARTS + 1 times, the request waits for RENEWALS_PER_REQUEST of them, then it is busy
    c = FakeClock(10.0)
    store = SlowStore(c, 0.003, *[[[1, 10, 1, 0, [b"L1", 1]]]] * 20, every=True)
    f, _, m = fleet(store, Leases(hint=4), clock=c)
    took = await f.take(spend(), c.t + 1.0, c)
    assert (took.status, took.retry_ms) == (TakeStatus.DENIED, 4)
    assert len(store.sent) == RENEWALS_PER_REQUEST * (LATE_PARTS + 1)
    assert sample(m, "leasehold_agent_pool_busy_denials_total", pool=POOL.id) == 1


async def test_the_newest_part_is_not_refunded_while_requests_wait_for_it():
    # a part whose refund is due the moment it lands (a short life, past its middle): the requests
    # waiting for the renewal that bought it take from it before any refund
    c = FakeClock(10.0)
    store = SlowStore(c, 0.002, [[3, 10, 3, 0, [b"L1", 3]]])
    f, _, _ = fleet(store, Leases(), clock=c)
    took = await asyncio.gather(*(f.take(spend(), c.t + 1.0, c) for _ in range(3)))
    assert [t.status for t in took] == [TakeStatus.OK] * 3 and len(store.sent) == 1
    assert store.refunds == []


async def test_an_empty_balance_waits_once_for_the_top_up_in_flight():
    loop = asyncio.get_running_loop()
    top_up = loop.create_future()
    store = Store(EMPTY, TAKEN_ALL)
    f, c, _ = fleet(store, Leases(pending=top_up))
    task = asyncio.ensure_future(f.take(spend(), c.t + BUDGET_S, c))
    # loop turns, not a sleep: the take is waiting for the top-up once the loop has run it this far
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(store.sent) == 1 and not task.done()
    top_up.set_result(None)
    took = await task
    assert took.status is TakeStatus.OK and len(store.sent) == 2


async def test_a_renewal_outlasting_the_budget_is_a_local_denial_not_a_fallback():
    store = Store(TAKEN_ALL)
    store.gate = asyncio.Event()
    f, c, m = fleet(store, Leases(hint=35))
    d = await f.take(spend(), c.t, c)  # no budget left
    assert (d.status, d.retry_ms, d.fallback) == (TakeStatus.DENIED, 35, False)
    assert sample(m, "leasehold_agent_pool_busy_denials_total", pool=POOL.id) == 1
    store.gate.set()  # the renewal still completes for the next requests
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert f.remaining(POOL.id) == 2000


async def test_a_request_takes_from_the_last_renewal_it_waited_for():
    """Four requests at once, renewals of 1, 1 and 2 tokens: each renewal pays the request that
    waited longest, and the fourth, which waited for all three, takes the last token of the third
    (it was denied as busy with that token in the chunk)."""
    store = Store([[1, 5000, 250, 0]], [[1, 4999, 250, 0]], [[2, 4997, 250, 0]])
    f, c, m = fleet(store, Leases())
    tasks = [asyncio.ensure_future(f.take(spend(), c.t + BUDGET_S, c)) for _ in range(4)]
    assert [t.status for t in await asyncio.gather(*tasks)] == [TakeStatus.OK] * 4
    assert len(store.sent) == 3 and f.remaining(POOL.id) == 0
    assert sample(m, "leasehold_agent_pool_busy_denials_total", pool=POOL.id) == 0


async def test_a_request_the_chunk_cannot_pay_buys_its_cost_alone():
    store = Store([[3, 1000, 250, 0]], [[5, 995, 250, 0]])  # a chunk of 3, then 5 bought alone
    f, c, m = fleet(store, Leases())
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK  # chunk of 3, 2 left
    alone = await f.take(spend(5), c.t + BUDGET_S, c)
    assert (alone.status, alone.generation) == (TakeStatus.OK, NO_CHUNK)
    assert store.sent[1] == [("pool_take", [GKEY], [5, 5, BALANCE_SLACK_MS, 0, 0])]  # exactly its cost
    assert f.remaining(POOL.id) == 2  # the chunk stays for the requests it can pay
    assert sample(m, "leasehold_agent_pool_renewals_total", pool=POOL.id, outcome="alone") == 1


async def test_an_expensive_request_denied_alone_does_not_deny_cheap_ones():
    store = Store([[3, 1000, 250, 0]], EMPTY)
    f, c, _ = fleet(store, Leases(hint=60))
    await f.take(spend(), c.t + BUDGET_S, c)
    denied = await f.take(spend(5), c.t + BUDGET_S, c)
    assert (denied.status, denied.retry_ms) == (TakeStatus.DENIED, 60)
    assert (await f.take(spend(1), c.t + BUDGET_S, c)).status is TakeStatus.OK  # paid by the chunk
    again = await f.take(spend(5), c.t + BUDGET_S, c)
    assert again.status is TakeStatus.DENIED and len(store.sent) == 2  # held locally for cost >= 5


# ------------------------------------------------------------------------------- allocator unreachable
async def test_allocator_unreachable_spends_the_regions_fallback_allowance_one_request_at_a_time():
    store = Store(EMPTY, [[1, 0, 0, 3999]])
    f, c, m = fleet(store, Leases(BalanceState.UNREACHABLE))
    took = await f.take(spend(), c.t + BUDGET_S, c)
    assert (took.status, took.fallback) == (TakeStatus.OK, True)
    (script, keys, argv) = store.sent[1][0]
    assert script == "multi_rule[pw]" and keys == [KeyBuilder.global_pool_decision_key(POOL.id),
                                                KeyBuilder.pool_fallback_key(GKEY)]
    # kind pw: fallbackPerRegion, the candidate windows, the cost, ttl past the last window
    assert argv[3:9] == ["pw", POOL.fallback_per_region, 5, 5, 1, 400 + POOL.window_ms]
    assert f.remaining(POOL.id) == 0  # a chunk of exactly one request's cost
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="ALLOCATOR_UNREACHABLE",
                  fail_mode="pool_fallback") == 1


async def test_a_closed_rule_never_spends_the_fallback_allowance():
    store = Store(EMPTY)
    f, c, _ = fleet(store, Leases(BalanceState.UNREACHABLE, hint=70))
    d = await f.take(spend(fail_mode="closed"), c.t + BUDGET_S, c)
    assert (d.status, d.fallback) == (TakeStatus.DENIED, False) and len(store.sent) == 1


async def test_an_uncertain_allocator_clock_denies_instead_of_counting_per_window():
    store = Store(EMPTY)
    wide = Windows(lo=5, hi=5 + MAX_SPAN, end_in_ms=900, safe_ms=0)
    f, c, _ = fleet(store, Leases(BalanceState.UNREACHABLE), windows=wide)
    d = await f.take(spend(), c.t + BUDGET_S, c)
    assert (d.status, d.retry_ms, d.fallback) == (TakeStatus.DENIED, 250, True)  # min(end, chunk validity)
    assert len(store.sent) == 1  # no allowance call


# ------------------------------------------------------------------------------- store failures
async def test_redis_unreachable_local_bounded_spends_the_in_process_allowance_up_to_its_bound():
    store = Store(*[StoreUnavailable("down")] * 4)
    small = msgspec.structs.replace(POOL, fallback_per_region=3)
    f, c, m = fleet(store, None)
    takes = [await f.take(GlobalSpend(RULE, small, 1), c.t + BUDGET_S, c) for _ in range(4)]
    assert [(t.status, t.fallback) for t in takes] == [(TakeStatus.OK, True)] * 3 + [(TakeStatus.DENIED, True)]
    assert takes[-1].retry_ms >= 1
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="POOL_RENEWAL_FAILED",
                  fail_mode="local_bounded") == 4


async def test_redis_unreachable_follows_the_rules_fail_mode():
    for mode, status, retry in (("open", TakeStatus.OPEN, 0), ("closed", TakeStatus.UNAVAILABLE, 5000)):
        f, c, _ = fleet(Store(StoreUnavailable("down")), Leases())
        d = await f.take(spend(fail_mode=mode), c.t + BUDGET_S, c)
        assert (d.status, d.retry_ms) == (status, retry)


async def test_overload_is_shed_and_a_script_rejection_fails_closed():
    f, c, _ = fleet(Store(Overloaded("queue full")), Leases())
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.SHED
    f, c, m = fleet(Store(ScriptRejected("bad call")), Leases())
    d = await f.take(spend(), c.t + BUDGET_S, c)  # local_bounded, yet never admitted after a policy defect
    assert (d.status, d.retry_ms) == (TakeStatus.UNAVAILABLE, RULE.closed_retry_after_ms)
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="POOL_POLICY_ERROR", fail_mode="closed") == 1


# ------------------------------------------------------------------------------- refunds
TAKEN_FROM_TWO = [[2000, 5000, 250, 0, [b"L1", 1500, b"L2", 500]]]  # and what it debited from each lease


async def _fire(f: FleetPools) -> None:
    """Run the pool's refund timer now (the test moves the clock; the timer's real delay is not waited)."""
    at, handle = f._timers.pop(POOL.id)
    handle.cancel()
    f._fire(POOL)
    await asyncio.gather(*f._refunding)


async def test_a_parts_rest_is_refunded_shortly_before_it_ends():
    store = Store(TAKEN_FROM_TWO, [[1999, b"refunded"]])
    f, c, m = fleet(store, Leases())
    sent_at = c.t * 1000.0
    assert (await f.take(spend(), c.t + BUDGET_S, c)).status is TakeStatus.OK
    lead = f.refund_lead_ms()
    assert lead == 50.0  # a fast store: the floor
    assert f._timers[POOL.id][0] == sent_at + 250 - lead
    c.t += (250 - lead - 10) / 1000  # a timer that fires early refunds nothing and is set again
    await _fire(f)
    assert len(store.sent) == 1 and f._timers[POOL.id][0] == sent_at + 250 - lead
    c.t += 10 / 1000
    await _fire(f)
    record = KeyBuilder.global_pool_refund_key(POOL.id, f"{f.nonce}-1")
    assert store.sent[1] == [("pool_refund", [GKEY, record], [1999, BALANCE_SLACK_MS, "L1", 1500, "L2", 500])]
    assert f.remaining(POOL.id) == 0  # taken out of the chunk first
    assert sample(m, "leasehold_agent_chunk_refunded_tokens_total", pool=POOL.id) == 1999
    assert sample(m, "leasehold_agent_chunk_abandoned_tokens_total", pool=POOL.id) == 0
    assert POOL.id not in f._timers  # nothing left to refund


async def test_a_refused_or_failed_refund_is_counted_abandoned_and_retried_once_with_its_id():
    store = Store(TAKEN_FROM_TWO, StoreUnavailable("down"), [[1500, b"replay"]])
    f, c, m = fleet(store, Leases())
    await f.take(spend(), c.t + BUDGET_S, c)
    c.t += 0.2
    await _fire(f)
    assert store.sent[1] == store.sent[2]  # the same refund id: a retry never gives back twice
    assert sample(m, "leasehold_agent_chunk_refunded_tokens_total", pool=POOL.id) == 1500
    assert sample(m, "leasehold_agent_chunk_abandoned_tokens_total", pool=POOL.id) == 499
    store = Store(TAKEN_FROM_TWO, StoreUnavailable("down"), StoreUnavailable("down"))
    f, c, m = fleet(store, Leases())
    await f.take(spend(), c.t + BUDGET_S, c)
    c.t += 0.2
    await _fire(f)
    assert len(store.sent) == 3 and f.remaining(POOL.id) == 0
    assert sample(m, "leasehold_agent_chunk_abandoned_tokens_total", pool=POOL.id) == 1999
