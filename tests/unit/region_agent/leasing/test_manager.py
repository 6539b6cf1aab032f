"""region_agent.leasing.manager: top-ups, deposits, closes and reports, driven with a manual clock,
an in-process allocator client and an in-process balance store (no network: the real client and
the Redis side are exercised by tests/integration/leases)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from kernel.bundle import Pool
from kernel.errors import Conflict, StoreUnavailable, Unavailable, ValidationFailed
from kernel.wire import LeaseError, LeaseGrant, LeaseRequest, UsageReceipt, UsageReport, WindowRef
from region_agent.leasing.book import BalanceState
from region_agent.leasing.manager import LeaseManager
from region_agent.service.metrics import AgentMetrics
from region_agent.store.scripts import PoolClosed
from tests.support.clock import FakeClock

POOL = Pool(id="atlas-minute", window_ms=60_000, limit=1_000, lease_ttl_ms=15_000, chunk_min=10, chunk_max=200)
KEY = "{t:atlas}:pool:atlas-minute"


def grant(req: LeaseRequest, granted: int = 100, *, epoch: int = 7, issued: int = 10_000, ttl: int = 10_000,
          end: int = 60_000, replayed: bool = False, lease_id: str | None = None) -> LeaseGrant:
    return LeaseGrant(lease_id=lease_id or req.lease_id, pool=req.pool, region=req.region, granted=granted,
                      window=WindowRef(index=0, start_ms=0, end_ms=end), expires_at_ms=issued + ttl, ttl_ms=ttl,
                      starts_in_ms=0, epoch=epoch, issued_at_ms=issued, remaining=900 - granted, replayed=replayed)


@dataclass
class Allocator:
    """Answers lease requests with ``answer(req)`` (a grant, or raises); records every request."""

    answer: object = None
    requests: list[LeaseRequest] = field(default_factory=list)
    reports: list[list[UsageReport]] = field(default_factory=list)
    report_answers: list[object] = field(default_factory=list)  # per report call: a status, or None = receipt
    returned: int = 0  # what each receipt says went back to the pool (its window open)
    last_rtt_ms: float = 40.0
    attempt_timeout_s: float = 0.5
    gate: asyncio.Event | None = None  # when set, lease() waits for it
    report_gate: asyncio.Event | None = None  # when set, report_many() waits for it

    async def lease(self, req: LeaseRequest) -> LeaseGrant:
        self.requests.append(req)
        if self.gate is not None:
            await self.gate.wait()
        return self.answer(req) if callable(self.answer) else grant(req)

    async def report_many(self, reports):
        self.reports.append(list(reports))
        if self.report_gate is not None:
            await self.report_gate.wait()
        status = self.report_answers.pop(0) if self.report_answers else None
        if status is None:
            return [UsageReceipt(lease_id=r.lease_id, granted=100, spent=r.spent, returned=self.returned,
                                 window_open=True) for r in reports]
        return [LeaseError(lease_id=r.lease_id, status=status, code="x", detail="d") for r in reports]


@dataclass
class Balances:
    """The Redis side: spendable tokens, clock offsets, deposits and closed records."""

    spendable: int = 0
    lo: float = 0.0
    hi: float = 0.0
    deposit_ok: bool = True
    closed: dict[str, PoolClosed | None] = field(default_factory=dict)
    deposits: list[tuple] = field(default_factory=list)
    closes: list[str] = field(default_factory=list)
    down: bool = False

    async def observe(self, key):
        if self.down:
            raise StoreUnavailable("redis down")
        return self.spendable, self.lo, self.hi

    async def deposit(self, key, lease_id, granted, valid_from_ms, expires_at_ms):
        if self.down:
            raise StoreUnavailable("redis down")
        self.deposits.append((key, lease_id, granted, valid_from_ms, expires_at_ms))
        return self.deposit_ok

    async def close(self, key, lease_id):
        if self.down:
            raise StoreUnavailable("redis down")
        self.closes.append(lease_id)
        return self.closed.get(lease_id, PoolClosed(granted=100, spent=0, current=True))


def manager(allocator: Allocator | None = None, balances: Balances | None = None, clock: FakeClock | None = None,
            **kw) -> LeaseManager:
    return LeaseManager(region="eu", client=allocator or Allocator(), store=balances or Balances(),  # type: ignore[arg-type]  # fakes with the methods the manager calls
                        now=clock or FakeClock(100_000.0), metrics=AgentMetrics(), **kw)


async def settle(m: LeaseManager) -> None:
    for bal in list(m.balances.values()):
        if bal.inflight is not None:
            await bal.inflight


def sample(m: LeaseManager, name: str, **labels) -> float:
    return m.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------- top-ups
async def test_demand_on_an_empty_balance_starts_one_top_up_and_deposits_the_grant():
    alloc, store, clock = Allocator(), Balances(), FakeClock(100_000.0)
    alloc.gate = asyncio.Event()
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    m.note(POOL, KEY, 1)  # single flight: the top-up in flight serves both
    assert m.pending(KEY) is not None
    alloc.gate.set()
    await settle(m)
    assert len(alloc.requests) == 1
    req = alloc.requests[0]
    assert (req.region, req.pool, req.window) == ("eu", POOL.id, "current") and req.lease_id.startswith("eu-")
    # the demand counted so far (2 tokens, over the 50 ms floor: 40 tokens/s) over the 2 s horizon
    assert req.want == 80
    (deposit,) = store.deposits
    assert deposit[:3] == (KEY, req.lease_id, 100)
    assert m.state(KEY) is BalanceState.OK
    assert m.balances[KEY].last_spendable == 100  # counted at once, before the next tick reads Redis
    assert m.pending(KEY) is None


async def test_a_deposit_spendable_at_once_is_announced_to_the_refill_listeners():
    """FleetPools lifts its chunk's local denial of a pool on it; a refused deposit, or a lease
    deposited to start later, announces nothing."""
    heard: list[str] = []
    m = manager()
    m.on_refill(heard.append)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert heard == [POOL.id]
    refused = manager(balances=Balances(deposit_ok=False))
    refused.on_refill(heard.append)
    refused.note(POOL, KEY, 1)
    await settle(refused)
    assert heard == [POOL.id]


async def test_a_lease_deposited_to_start_later_announces_no_refill():
    clock = FakeClock(100_000.0)
    alloc, store = leasing_to_the_window_end(clock), Balances(spendable=100)
    m = manager(alloc, store, clock)
    heard: list[str] = []
    m.note(POOL, KEY, 1)
    await settle(m)
    m.on_refill(heard.append)
    for _ in range(11):  # until the next window's lease is asked for ahead and deposited
        clock.advance(100.0)
        m.note(POOL, KEY, 1)
        await m.tick()
        await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next"] and len(store.deposits) == 2
    assert heard == []


async def test_deposit_bounds_are_conservative_on_the_redis_clock():
    """Until the lower offset: never spendable later on Redis's clock than on this process's
    monotonic clock. A prefetched lease is valid from the upper offset (rounded up): never
    spendable before its window begins. A lease of the window in progress is spendable at once."""
    store = Balances(lo=5_000.0, hi=5_060.4)  # a Redis round trip of 60 ms: that much uncertainty
    clock = FakeClock(100_000.0)
    m = manager(Allocator(), store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    (_, _, _, valid_from, expires_at) = store.deposits[0]
    assert valid_from == 105_000  # received (100_000) + lo: already begun on Redis's clock
    assert expires_at == 115_000  # sent (100_000) + ttl (10_000) + lo (5_000)

    store = Balances(lo=5_000.0, hi=5_060.4)
    m = manager(Allocator(answer=lambda req: msgspec.structs.replace(grant(req), starts_in_ms=2_000)), store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    (_, _, _, valid_from, _) = store.deposits[0]
    assert valid_from == 107_061  # received (100_000) + starts in (2_000) + hi (5_060.4), rounded up


async def test_a_refused_deposit_is_reported_closed_early_and_backs_off():
    store = Balances(deposit_ok=False)
    alloc = Allocator()
    m = manager(alloc, store)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.balances[KEY].book.leases == {}  # certainly nothing written: forgotten
    ((report, _),) = m.pending_reports
    assert (report.spent, report.closed_early) == (0, True)
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="undeposited") == 1
    m.note(POOL, KEY, 1)  # within the refusal back-off: no new lease request
    assert m.pending(KEY) is None and len(alloc.requests) == 1


async def test_a_grant_too_late_for_its_window_is_followed_by_the_new_windows_lease():
    """Woken near a window's end (an idle spell let the leases lapse), the balance is granted a
    lease of a window that ends before the answer arrives: nothing to spend. The same top-up asks
    at once for the window that has begun since, so the waiting decision finds a lease."""
    clock = FakeClock(100_000.0)
    answers = iter([dict(issued=10_000, ttl=30, end=10_030),  # ends 30 ms after sending; the answer takes 80
                    dict(issued=10_080, ttl=1_000, end=11_030)])

    def answer(req: LeaseRequest) -> LeaseGrant:
        clock.advance(80.0)  # the round trip
        return grant(req, **next(answers))

    alloc, store = Allocator(answer=answer), Balances()
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "current"]
    (deposit,) = store.deposits  # only the second: the first could not be spent
    assert deposit[1] == alloc.requests[1].lease_id
    assert m.balances[KEY].book.valid(clock()) and m.balances[KEY].last_spendable == 100


async def test_a_grant_that_arrives_just_before_its_window_ends_is_kept_and_the_next_windows_follows():
    """The grant arrives 10 ms before its window ends: it is spendable at once for those 10 ms
    (whatever the Redis clock offset's uncertainty), and the next window's lease is asked for in
    the same top-up (prefetch)."""
    clock = FakeClock(100_000.0)
    answers = iter([dict(issued=10_000, ttl=30, end=10_030), dict(issued=10_020, ttl=1_000, end=11_030)])

    def answer(req: LeaseRequest) -> LeaseGrant:
        clock.advance(20.0)
        return grant(req, **next(answers))

    alloc, store = Allocator(answer=answer), Balances(lo=-15.0, hi=40.0)
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next"]
    first = store.deposits[0]
    assert first[1] == alloc.requests[0].lease_id and (first[3], first[4]) == (100_005, 100_015)
    assert [d[1] for d in store.deposits] == [r.lease_id for r in alloc.requests]


def next_grant(req: LeaseRequest, granted: int = 100, *, issued: int, starts_in: int) -> LeaseGrant:
    """A lease of window 1 (60,000-120,000), granted ``starts_in`` ms before it starts."""
    return LeaseGrant(lease_id=req.lease_id, pool=req.pool, region=req.region, granted=granted,
                      window=WindowRef(index=1, start_ms=60_000, end_ms=120_000), expires_at_ms=75_000,
                      ttl_ms=75_000 - issued, starts_in_ms=starts_in, epoch=7, issued_at_ms=issued,
                      remaining=1_000 - granted)


def leasing_to_the_window_end(clock: FakeClock, *, rtt: float = 40.0):
    """An allocator that grants a current lease lasting to its window's end (issued 3 s before it,
    the allocator's clock 48 s behind this one) and next-window leases; refuses a prefetch asked
    too early on its own clock, as the allocator does."""
    def answer(req: LeaseRequest) -> LeaseGrant:
        issued = int(clock() - 100_000 + 57_000)
        if req.window == "current":
            return grant(req, issued=issued, ttl=60_000 - issued, end=60_000)
        if 60_000 - issued > POOL.prefetch_ms:
            raise Conflict("prefetch opens later")
        return next_grant(req, issued=issued, starts_in=60_000 - issued)

    return Allocator(answer=answer, last_rtt_ms=rtt)


async def prefetched(alloc: Allocator, store: Balances, clock: FakeClock) -> LeaseManager:
    """A balance leased to its window's end (103,000), then 1.8 s before that end a tick that asks
    for the next window's lease (spendable from 103,000)."""
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    clock.advance(1_200.0)
    m.note(POOL, KEY, 1)
    await m.tick()
    await settle(m)
    return m


async def test_a_balance_whose_lease_lasts_to_the_window_end_asks_for_the_next_window_ahead():
    """The last lease of a window pays until the window ends, so no top-up is started before it:
    the tick asks for the next window's lease once the window ends within the pool's prefetch time
    less a round trip (never earlier: the allocator would refuse it), deposits it valid from the
    window's start, and asks no more while it is held."""
    clock = FakeClock(100_000.0)
    alloc, store = leasing_to_the_window_end(clock), Balances(spendable=100)
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current"]  # the window ends in 3 s: no prefetch yet
    for _ in range(10):  # ticks every 100 ms until 2,000 ms before the end (+ 40 ms round trip): not yet
        clock.advance(100.0)
        m.note(POOL, KEY, 1)
        await m.tick()
        await settle(m)
    assert [r.window for r in alloc.requests] == ["current"]
    clock.advance(100.0)  # 1,900 ms before the end: within prefetchMs (2,000) less the round trip (40)
    m.note(POOL, KEY, 1)
    await m.tick()
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next"]
    prefetched = store.deposits[-1]
    assert prefetched[1] == alloc.requests[-1].lease_id and prefetched[3] == 103_000  # valid from the window's start
    for _ in range(5):
        clock.advance(100.0)
        m.note(POOL, KEY, 1)
        await m.tick()
        await settle(m)
    assert len(alloc.requests) == 2  # held: not asked again


async def test_an_exhausted_balance_asks_for_the_next_window_ahead():
    """The allocator said the window is spent: no top-up until it ends, but the next window's lease
    is asked for within the prefetch time, so the rollover's requests do not wait for one."""
    clock = FakeClock(100_000.0)
    answers = iter([lambda req: grant(req, 0, issued=58_500, end=60_000),
                    lambda req: next_grant(req, issued=58_600, starts_in=1_400)])
    alloc, store = Allocator(answer=lambda req: next(answers)(req)), Balances()
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.state(KEY) is BalanceState.EXHAUSTED
    clock.advance(100.0)
    await m.tick()
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next"]
    assert store.deposits[-1][3] == 101_500 and m.state(KEY) is BalanceState.EXHAUSTED  # spendable from the window's start


async def test_a_prefetch_that_got_no_lease_is_asked_again_only_after_a_pause():
    """The allocator refused the prefetch (too early on its clock): the next ticks do not ask again
    at once, but after PREFETCH_RETRY_MS."""
    clock = FakeClock(100_000.0)
    calls = []

    def answer(req: LeaseRequest) -> LeaseGrant:
        calls.append(req.window)
        if req.window == "current":
            return grant(req, issued=58_500, ttl=1_500, end=60_000)
        raise Conflict("prefetch opens later")

    alloc = Allocator(answer=answer)
    m = manager(alloc, Balances(spendable=100), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert calls == ["current", "next"]  # the top-up near the end asked for it too (refused)
    for _ in range(3):
        clock.advance(100.0)
        m.note(POOL, KEY, 1)
        await m.tick()
        await settle(m)
    assert calls == ["current", "next", "next"]  # the tick's first prefetch, then none for 250 ms
    clock.advance(100.0)
    await m.tick()
    await settle(m)
    assert calls == ["current", "next", "next", "next"]


async def test_an_idle_balance_does_not_prefetch():
    """Nobody spent from it within the horizon: a next-window lease would expire unspent."""
    clock = FakeClock(100_000.0)
    alloc = leasing_to_the_window_end(clock)
    m = manager(alloc, Balances(spendable=100), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    clock.advance(2_500.0)  # 500 ms before the end, the last decision 2.5 s ago (horizon: 2 s)
    await m.tick()
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current"]


async def test_an_empty_balance_whose_next_lease_starts_within_a_round_trip_waits_for_it():
    """The window's last lease ran out 30 ms before its end and the next window's is held: a top-up
    (40 ms round trip) would be granted after the window it is for, so none is asked; the decision
    is handed a future done when the next lease starts, and waits for that instead."""
    clock = FakeClock(100_000.0)
    alloc, store = leasing_to_the_window_end(clock), Balances(spendable=100)
    m = await prefetched(alloc, store, clock)
    assert [r.window for r in alloc.requests] == ["current", "next"]  # prefetched: starts at 103,000
    # 100 ms before it starts, a top-up could still land in time: it is asked for
    clock.t = 102_900.0
    assert m.observed(KEY, 0, starts_in_ms=100) is m.pending(KEY) is not None
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next", "current"]
    clock.t = 102_970.0
    m.note(POOL, KEY, 1)
    starts = m.observed(KEY, 0, starts_in_ms=30)
    assert starts is not None and m.pending(KEY) is None  # no top-up: a lease start to wait for
    assert not starts.done() and m.observed(KEY, 0, starts_in_ms=29) is starts  # one wait for every decision
    await asyncio.wait_for(starts, 1.0)  # done about 31 ms later (real time: the loop's timer)
    store.spendable = 0
    await m.tick()  # the tick asks for no top-up either
    await settle(m)
    assert len(alloc.requests) == 3


async def test_a_next_lease_starting_later_than_a_round_trip_is_waited_for_within_the_decisions_budget():
    """A 600 ms round trip: 900 ms before the window's end no top-up is asked (the next window's lease
    starts within two round trips), and that lease starts later than a round trip. A decision whose
    budget covers the wait is handed its start (it was denied until then, its budget left unused);
    one whose budget does not is denied at once, as before."""
    clock = FakeClock(100_000.0)
    alloc, store = leasing_to_the_window_end(clock, rtt=600.0), Balances(spendable=100)
    m = await prefetched(alloc, store, clock)
    clock.t = 101_700.0  # (the prefetch is asked a round trip earlier)
    m.note(POOL, KEY, 1)
    await m.tick()
    await settle(m)
    assert [r.window for r in alloc.requests] == ["current", "next"]  # the next lease starts at 103,000
    clock.t = 102_100.0
    m.note(POOL, KEY, 1)
    assert m.observed(KEY, 0, starts_in_ms=900, within_ms=50.0) is None  # a 50 ms budget: no wait
    starts = m.observed(KEY, 0, starts_in_ms=900, within_ms=4_975.0)
    assert starts is not None and m.pending(KEY) is None  # no top-up: the held lease's start
    assert m.lease_start(KEY, 899) is starts  # one wait for every decision
    starts.cancel()
    assert len(alloc.requests) == 2


async def test_the_next_windows_lease_counts_from_its_start_so_the_rollover_asks_for_no_second_lease():
    """Redis read 0 before the next window's lease started (and may still, for the clock offset's
    uncertainty, just after): the decisions right after its start count it, and start no top-up
    that would take a second lease of the window. A reading taken once it is surely spendable in
    Redis is the balance again."""
    clock = FakeClock(100_000.0)
    alloc, store = leasing_to_the_window_end(clock), Balances(spendable=100, lo=-5.0, hi=5.0)
    m = await prefetched(alloc, store, clock)
    assert [r.window for r in alloc.requests] == ["current", "next"]  # the next lease: 100 tokens from 103,000
    store.spendable = 0
    clock.t = 102_990.0
    await m.tick()  # the current lease is spent; the next one has not started
    clock.t = 103_001.0
    for _ in range(5):
        m.note(POOL, KEY, 1)
    assert m.pending(KEY) is None and m.balances[KEY].spendable(clock()) == 100
    clock.t = 103_012.0  # surely spendable in Redis from 103,011 (its start + the offsets' spread + 1)
    await m.tick()
    assert m.balances[KEY].spendable(clock()) == 0  # the reading again (this one says 0)
    assert m.pending(KEY) is not None  # below the low-water mark: a top-up
    await settle(m)


async def test_a_grant_redis_did_not_take_asks_for_no_other_window():
    """Nothing is asked beyond the refused deposit, even near the window's end (Redis would refuse
    the next one too)."""
    clock = FakeClock(100_000.0)
    alloc = Allocator(answer=lambda req: grant(req, issued=10_000, ttl=30, end=10_030))
    m = manager(alloc, Balances(deposit_ok=False), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert len(alloc.requests) == 1


async def test_a_grant_with_an_older_epoch_is_refused_and_not_deposited():
    epochs = iter([9, 8])
    alloc = Allocator(answer=lambda req: grant(req, epoch=next(epochs)))
    store = Balances()
    m = manager(alloc, store)
    m.note(POOL, KEY, 1)
    await settle(m)
    m.balances[KEY].last_spendable = 0  # spent: the next decision asks again
    m.observed(KEY, 0)
    await settle(m)
    assert len(alloc.requests) == 2 and len(store.deposits) == 1
    assert m.balances[KEY].book.max_epoch == 9
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="stale_epoch") == 1


async def test_a_zero_grant_means_exhausted_until_the_window_end():
    clock = FakeClock(100_000.0)
    alloc = Allocator(answer=lambda req: grant(req, 0, issued=50_000, end=60_000))
    m = manager(alloc, Balances(), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.state(KEY) is BalanceState.EXHAUSTED
    assert m.retry_hint_ms(KEY) == 10_000  # the window ends 10 s after issue, timed from the send
    m.note(POOL, KEY, 1)
    assert m.pending(KEY) is None  # no top-up while exhausted
    clock.t += 10_000
    assert m.state(KEY) is BalanceState.OK


async def test_tokens_our_report_returns_to_an_exhausted_window_are_asked_for_again():
    """A lease of ours expired with tokens unspent and its report gave them back to the window, after
    the allocator had said the window is exhausted: the balance asks again (else nobody would - every
    balance told "exhausted" waits for the next window - and those tokens would go unused while
    requests are denied). A report that returned nothing changes nothing."""
    clock = FakeClock(100_000.0)
    answers = [grant(LeaseRequest(lease_id="x", region="eu", pool=POOL.id, want=1), 0, issued=50_000, end=60_000)]
    alloc = Allocator(answer=lambda req: answers.pop(0) if answers else grant(req, 40, issued=51_000, end=60_000))
    m = manager(alloc, Balances(), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.state(KEY) is BalanceState.EXHAUSTED
    bal = m.balances[KEY]
    m._queue_report(bal, "eu-old", 5)
    await m._flush_reports()  # returned nothing
    assert m.state(KEY) is BalanceState.EXHAUSTED
    alloc.returned = 7
    m._queue_report(bal, "eu-older", 3)
    await m._flush_reports()
    assert m.state(KEY) is BalanceState.OK
    m.note(POOL, KEY, 1)  # the next decision starts a top-up
    await settle(m)
    assert len(alloc.requests) == 2 and m.balances[KEY].last_spendable == 40


async def test_unreachable_only_once_no_held_lease_is_valid():
    clock = FakeClock(100_000.0)
    answers = [None, Unavailable("allocator down")]

    def answer(req):
        a = answers.pop(0)
        if a is not None:
            raise a
        return grant(req, ttl=10_000)

    alloc = Allocator(answer=answer)
    m = manager(alloc, Balances(), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    m.observed(KEY, 0)  # the balance is spent: ask again, the allocator is down now
    await settle(m)
    assert m.state(KEY) is BalanceState.OK  # the held lease is still valid
    assert m.retry_hint_ms(KEY) == 41  # a top-up's round trip
    clock.t += 10_000  # the held lease's deadline (sent + ttl)
    assert m.state(KEY) is BalanceState.UNREACHABLE
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="unreachable") == 1


async def test_a_failure_while_this_process_stalled_is_not_unreachable(caplog):
    """SIGSTOPped for longer than the client's deadline: on waking the request fails at once (its
    timer fired late) although the allocator was never asked in vain. That opens no fallback
    allowance (the window's tokens are the allocator's, and a stall is no fault of its link); the
    next tick asks again, and a failure with the loop on time is unreachable as before."""
    clock = FakeClock(100_000.0)
    lag = [0.0]  # seconds: the event loop's lateness when the answer is handled
    answers = [None, Unavailable("attempt timed out"), Unavailable("attempt timed out")]

    def answer(req):
        a = answers.pop(0)
        if a is not None:
            raise a
        return grant(req, ttl=1_000)

    m = manager(Allocator(answer=answer), Balances(), clock, lag_s=lambda: lag[0])
    reachable = lambda: m.metrics.registry.get_sample_value("leasehold_agent_allocator_reachable")  # noqa: E731
    m.note(POOL, KEY, 1)
    await settle(m)
    assert reachable() == 1
    clock.t += 3_000  # stopped: the held lease ended meanwhile
    lag[0] = 3.0
    m.observed(KEY, 0)
    await settle(m)
    assert m.state(KEY) is BalanceState.OK and m.balances[KEY].book.unreachable_since is None
    assert reachable() == 1 and len(answers) == 1
    assert "refused" not in caplog.text and "unreachable" not in caplog.text  # neither a refusal nor a cut
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="unreachable") == 1
    lag[0] = 0.2  # a busy loop, but late by less than the 0.5 s attempt timeout
    m.observed(KEY, 0)
    await settle(m)
    assert m.state(KEY) is BalanceState.UNREACHABLE and reachable() == 0


async def test_a_refusal_is_not_unreachable():
    def answer(req):
        raise ValidationFailed("unknown pool")

    m = manager(Allocator(answer=answer), Balances())
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.state(KEY) is BalanceState.OK  # a refusal never opens the fallback allowance
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="refused") == 1


async def test_grants_place_the_allocator_clock_but_replays_do_not():
    clock = FakeClock(100_000.0)
    replay = [False, True]
    m = manager(Allocator(answer=lambda req: grant(req, issued=7_000_000, end=7_060_000,
                                                                   replayed=replay.pop(0))), Balances(),
                clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.clock.known
    lo, hi = m.clock.bounds(100_000.0, 0.0)
    assert lo <= 7_000_000 <= hi
    m.observed(KEY, 0)
    clock.t += 1_000
    await settle(m)  # a replay carries the original issuedAtMs: it must not move the estimate
    assert m.clock.bounds(100_000.0, 0.0) == (lo, hi)


async def test_idle_state_and_hints_for_a_balance_nobody_used():
    m = manager()
    assert m.state("nothing") is BalanceState.IDLE
    assert m.retry_hint_ms("nothing") == 0 and m.pending("nothing") is None and m.observed("nothing", 5) is None


# ------------------------------------------------------------------------------- closes and reports
async def _held(m: LeaseManager) -> str:
    m.note(POOL, KEY, 1)
    await settle(m)
    (lease_id,) = m.balances[KEY].book.leases
    return lease_id


async def test_an_expired_lease_is_closed_and_its_spend_reported():
    clock = FakeClock(100_000.0)
    alloc, store = Allocator(), Balances(spendable=500)  # full: the tick asks for nothing more
    m = manager(alloc, store, clock)
    lease_id = await _held(m)
    store.closed[lease_id] = PoolClosed(granted=100, spent=30, current=True)
    clock.t += 10_000
    await m.tick()
    assert store.closes == [lease_id] and m.balances[KEY].book.leases == {}
    ((report,),) = alloc.reports
    assert (report.lease_id, report.spent, report.closed_early) == (lease_id, 30, False)
    assert sample(m, "leasehold_agent_stranded_tokens_total", pool=POOL.id) == 70
    assert not m.pending_reports


async def test_a_lost_or_restored_record_is_reported_fully_spent():
    """docs/invariants.md I8: lost knowledge counts as spent (stranded, never returned)."""
    for record, unaccounted in ((None, 100), (PoolClosed(granted=100, spent=40, current=False), 60)):
        clock = FakeClock(100_000.0)
        alloc, store = Allocator(), Balances(spendable=500)
        m = manager(alloc, store, clock)
        lease_id = await _held(m)
        store.closed[lease_id] = record
        clock.t += 10_000
        await m.tick()
        ((report,),) = alloc.reports
        assert report.spent == 100
        assert sample(m, "leasehold_agent_lease_lost_tokens_total", pool=POOL.id) == unaccounted


async def test_a_close_redis_cannot_answer_is_tried_again_next_tick():
    clock = FakeClock(100_000.0)
    alloc, store = Allocator(), Balances(spendable=500)
    m = manager(alloc, store, clock)
    lease_id = await _held(m)
    clock.t += 10_000
    store.down = True
    await m.tick()
    assert lease_id in m.balances[KEY].book.leases and not alloc.reports
    store.down = False
    await m.tick()
    assert store.closes == [lease_id] and len(alloc.reports) == 1


async def test_reports_the_allocator_cannot_take_stay_queued_and_409s_are_retried_with_patience():
    clock = FakeClock(100_000.0)
    alloc = Allocator()
    m = manager(alloc, Balances(), clock, report_patience_ms=1_000)
    bal_pool = POOL
    m.note(bal_pool, KEY, 1)
    await settle(m)
    bal = m.balances[KEY]
    m._queue_report(bal, "eu-a", 5)
    m._queue_report(bal, "eu-b", 6)
    alloc.report_answers = [503]
    await m._flush_reports()
    assert [r.lease_id for r, _ in m.pending_reports] == ["eu-a", "eu-b"]  # kept, in order
    alloc.report_answers = [409]
    await m._flush_reports()
    assert len(m.pending_reports) == 2  # not yet expired at the allocator: retried later
    clock.t += 1_000
    alloc.report_answers = [409]
    await m._flush_reports()
    assert not m.pending_reports  # past its patience: dropped (the allocator counts it spent)
    alloc.report_answers = [400]
    m._queue_report(bal, "eu-c", 1)
    await m._flush_reports()
    assert not m.pending_reports  # a refused report is not retried


async def test_reports_a_flush_is_sending_are_still_pending_and_a_cancelled_flush_keeps_them():
    """The flush takes the queue and waits on the allocator: /v1/leases' pendingReports read 0 all
    that time (a test polled it 20 times during one flush under load and saw only zeros), and a
    flush cancelled on its way (SIGTERM's shutdown cancels the tick) lost the reports it held: the
    shutdown then said "0 usage reports not delivered" of reports it never sent."""
    alloc = Allocator(report_gate=asyncio.Event())
    m = manager(alloc)
    m.note(POOL, KEY, 1)
    await settle(m)
    bal = m.balances[KEY]
    for i in range(3):
        m._queue_report(bal, f"eu-{i}", i)
    flush = asyncio.create_task(m._flush_reports())
    for _ in range(10):  # the flush runs up to the allocator's answer
        await asyncio.sleep(0)
    assert alloc.reports
    assert not m.pending_reports and m.reports_pending == 3  # on their way, not delivered
    m._queue_report(bal, "eu-3", 3)  # a lease ending meanwhile
    assert m.reports_pending == 4
    flush.cancel()
    await asyncio.gather(flush, return_exceptions=True)
    assert [r.lease_id for r, _ in m.pending_reports] == ["eu-0", "eu-1", "eu-2", "eu-3"]  # back, in order
    assert m.reports_pending == 4
    alloc.report_gate.set()
    await m._flush_reports()
    assert m.reports_pending == 0 and [r.lease_id for r in alloc.reports[-1]] == ["eu-0", "eu-1", "eu-2", "eu-3"]


async def test_the_report_queue_is_bounded():
    m = manager(max_pending_reports=2)
    m.note(POOL, KEY, 1)
    await settle(m)
    bal = m.balances[KEY]
    for i in range(5):
        m._queue_report(bal, f"eu-{i}", 1)
    assert [r.lease_id for r, _ in m.pending_reports] == ["eu-0", "eu-1"]


async def test_an_idle_balance_without_leases_is_forgotten():
    clock = FakeClock(100_000.0)
    m = manager(Allocator(answer=lambda req: grant(req, 0)), Balances(), clock, idle_after_ms=30_000)
    m.note(POOL, KEY, 1)
    await settle(m)
    await m.tick()
    assert KEY in m.balances
    clock.t += 30_001
    await m.tick()
    assert KEY not in m.balances


# ------------------------------------------------------------------------------- cold start and shutdown
async def test_warm_up_leases_each_empty_balance_and_skips_a_held_one():
    alloc = Allocator()
    alloc.gate = asyncio.Event()
    m = manager(alloc, Balances())
    m.warm_up([(POOL, KEY)])
    await asyncio.sleep(0)
    assert m.warming
    alloc.gate.set()
    await asyncio.gather(*m._warming)
    assert not m.warming
    assert len(alloc.requests) == 1
    held = manager(alloc2 := Allocator(), Balances(spendable=50))
    held.warm_up([(POOL, KEY)])
    await asyncio.gather(*held._warming)
    assert alloc2.requests == []  # another agent of the region already holds a lease


async def test_shutdown_closes_held_leases_early_and_reports_them():
    alloc, store = Allocator(), Balances(spendable=500)
    m = manager(alloc, store)
    lease_id = await _held(m)
    store.closed[lease_id] = PoolClosed(granted=100, spent=12, current=True)
    closed, unsent = await m.shutdown(timeout_s=1.0)
    assert (closed, unsent) == (1, 0)
    ((report,),) = alloc.reports
    assert (report.lease_id, report.spent, report.closed_early) == (lease_id, 12, True)
    m.note(POOL, KEY, 1)  # no new lease request after shutdown began
    assert m.pending(KEY) is None and len(alloc.requests) == 1


async def test_begin_shutdown_stops_new_lease_requests_at_once():
    alloc = Allocator()
    m = manager(alloc, Balances())
    m.begin_shutdown()
    m.note(POOL, KEY, 1)
    assert m.pending(KEY) is None and alloc.requests == []


async def test_a_grant_redis_cannot_take_goes_back_at_once_and_backs_off():
    """Redis unreachable when a grant arrives: nothing was written, so the lease is reported closed
    early with nothing spent, and the decisions of the outage ask for no lease until the back-off
    is over (one grant per decision drained the window's G, every lease stranded)."""
    clock = FakeClock(100_000.0)
    store, alloc = Balances(down=True), Allocator()
    m = manager(alloc, store, clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert m.balances[KEY].book.leases == {} and store.deposits == []
    ((report, _),) = m.pending_reports
    assert (report.lease_id, report.spent, report.closed_early) == (alloc.requests[0].lease_id, 0, True)
    assert sample(m, "leasehold_agent_lease_grants_total", pool=POOL.id, outcome="undeposited") == 1
    for _ in range(50):  # the outage's decisions
        m.note(POOL, KEY, 1)
        await settle(m)
    assert len(alloc.requests) == 1
    clock.t += 1_001  # past the back-off: one more try
    m.note(POOL, KEY, 1)
    await settle(m)
    assert len(alloc.requests) == 2


async def test_an_ambiguous_deposit_keeps_its_lease_and_backs_off():
    """A deposit that failed in flight may have landed: the lease stays in the book (closed and
    reported at its deadline), and no other lease is asked for during the back-off."""
    clock = FakeClock(100_000.0)

    class Flaky(Balances):
        async def deposit(self, key, lease_id, granted, valid_from_ms, expires_at_ms):
            raise StoreUnavailable("connection lost mid-call")

    alloc = Allocator()
    m = manager(alloc, Flaky(), clock)
    m.note(POOL, KEY, 1)
    await settle(m)
    assert list(m.balances[KEY].book.leases) == [alloc.requests[0].lease_id] and not m.pending_reports
    for _ in range(20):
        m.note(POOL, KEY, 1)
        await settle(m)
    assert len(alloc.requests) == 1


def test_the_allocator_reads_reachable_before_the_first_call():
    """0 means the last call failed: a manager that has not asked yet says 1. With --workers N the
    gauge exported is the lowest of the live workers' (multiprocess mode livemin): a worker that
    had not asked yet read 0 beside one that had been granted, and LeaseholdAllocatorUnreachable
    went pending at the start of a healthy 2-worker agent under a real Prometheus."""
    m = manager()
    assert sample(m, "leasehold_agent_allocator_reachable") == 1


def test_the_records_linger_is_the_allocators():
    """A 404 for a report is expected once the allocator retired the window's records: the agent's
    idea of when that is must be the allocator's."""
    from allocator.window_cache import RECORD_MIN_LINGER_MS
    from region_agent.leasing import manager as mgr

    assert mgr.RECORD_MIN_LINGER_MS == RECORD_MIN_LINGER_MS
