"""The agent's approximate rules (region_agent.decision.approx) over a store that fails, then answers:
an injected clock, the store as an object with the Store protocol's ``submit``."""

from __future__ import annotations

from kernel.algorithms import make_rule
from kernel.algorithms.rule import Approximate
from kernel.errors import StoreUnavailable
from region_agent.decision.approx import ApproxRules
from region_agent.decision.plan import ApproxSpend
from region_agent.models import DeniedScope, Reason

W = 60_000
RULE = make_rule(id="ceiling", scope="tenant", algorithm="fixed_window", fail_mode="local_bounded", limit=100,
                 window_ms=W, approximate=Approximate(reconcile_ms=1_000, local_max=4))
SPEND = [ApproxSpend(RULE, "rl:v3:{t:atlas}:tenant:atlas:all:approx")]


class Store:
    def __init__(self):
        self.up = False
        self.counts: dict[int, int] = {}
        self.now_ms = 10 * W
        self.calls: list = []

    async def submit(self, calls, *, wait_s):
        self.calls.append(calls)
        if not self.up:
            raise StoreUnavailable("redis unreachable")
        out = []
        for _name, _keys, argv in calls:
            cur = self.now_ms // argv[0]
            for i in range(2, len(argv), 2):
                if argv[i + 1] > 0 and argv[i] >= cur - 1:
                    self.counts[min(argv[i], cur)] = self.counts.get(min(argv[i], cur), 0) + argv[i + 1]
            out.append([self.now_ms, self.counts.get(cur, 0), self.counts.get(cur - 1, 0)])
        return out


class Clock:
    def __init__(self, store: Store):
        self.store = store

    def __call__(self) -> float:
        return self.store.now_ms / 1000.0


async def test_with_redis_unreachable_an_agent_admits_local_max_per_window_then_flushes_when_it_returns():
    store = Store()
    clock = Clock(store)
    rules = ApproxRules(store, clock=clock, wall_clock=clock)
    try:
        taken = [rules.take(SPEND, 1) for _ in range(6)]
        assert [t[1] is None for t in taken] == [True] * 4 + [False] * 2
        denied = taken[4][1]
        assert (denied.scope, denied.reason, denied.limit) == (DeniedScope.TENANT, Reason.RATE_EXCEEDED, 100)
        store.now_ms += 1_000
        assert await rules.reconcile_once() == 0  # unreachable: the deltas stay
        assert rules.take(SPEND, 1)[1] is not None  # still at localMax unseen
        store.now_ms += 1_000
        store.up = True
        assert await rules.reconcile_once() == 1
        assert store.counts == {10: 4}  # sent once it could be, not lost, not doubled
        assert rules.take(SPEND, 1)[1] is None
    finally:
        await rules.close()
    assert store.counts == {10: 5}  # close flushed the last unit


async def test_a_denied_request_gives_its_units_back():
    store = Store()
    store.up = True
    clock = Clock(store)
    rules = ApproxRules(store, clock=clock, wall_clock=clock)
    try:
        tickets, denied = rules.take(SPEND, 3)
        assert denied is None
        rules.give_back(tickets)
        store.now_ms += 2_000
        await rules.reconcile_once()
        assert store.counts == {}
    finally:
        await rules.close()
