"""Approximate rules in this agent process: the counters of :mod:`kernel.approx` and the task that
reconciles them with Redis (``lua/approx_reconcile.lua``, through the store like any script call,
so a Redis Cluster routes each key to its primary and its breaker).

The engine asks :meth:`ApproxRules.take` for a plan's approximate rules before its script call
(a denial there is the decision, with no store call); the units taken for a request that another
rule then denies are given back (:meth:`ApproxRules.give_back`). The reconciler starts with the
first approximate request and runs until :meth:`ApproxRules.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from kernel.approx import ApproxCounters, StoreClock
from kernel.errors import LeaseholdError

from ..models import DeniedScope, Reason
from ..store.protocol import Store
from .outcome import Answer
from .plan import ApproxSpend

log = logging.getLogger(__name__)

SCRIPT = "approx_reconcile"
TICK_MIN_S, TICK_MAX_S = 0.01, 1.0
SEND_WAIT_S = 1.0  # one reconciliation round's bound
SLACK_MS = 5_000  # the counter hash outlives its next window by this much

Ticket = tuple[str, int, int]


class ApproxRules:
    def __init__(self, store: Store, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, counters: ApproxCounters | None = None):
        self.store = store
        self.clock = clock
        self.wall_clock = wall_clock
        self.counters = counters or ApproxCounters()
        self.store_clock = StoreClock()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False

    def now_ms(self) -> float:
        return self.store_clock.now(self.clock() * 1000.0, self.wall_clock() * 1000.0)

    # ------------------------------------------------------------------ decisions
    def take(self, spends: Sequence[ApproxSpend], cost: int) -> tuple[list[Ticket], Answer | None]:
        """Count ``cost`` on every approximate key of a request; the first denial is the answer
        (the units taken before it are given back)."""
        self._ensure_running()
        now = self.now_ms()
        tickets: list[Ticket] = []
        for spend in spends:
            got = self.counters.take(spend.key, spend.rule, cost, now)
            if not got.allowed:
                self.give_back(tickets)
                if self.counters.urgent:
                    self._poke()
                rule = spend.rule
                return [], Answer(False, rule, DeniedScope(rule.scope), Reason.RATE_EXCEEDED,
                                  getattr(rule, "limit", None), got.remaining, got.retry_ms)
            if got.ticket is not None:
                tickets.append(got.ticket)
        if self.counters.urgent:
            self._poke()
        return tickets, None

    def give_back(self, tickets: Sequence[Ticket]) -> None:
        for t in tickets:
            self.counters.give_back(t)

    # ------------------------------------------------------------------ reconciliation
    async def reconcile_once(self) -> int:
        """Send every due key's delta and read its counts back; the number of keys reconciled."""
        due = self.counters.due(self.now_ms())
        if not due:
            return 0
        calls = []
        for r in due:
            argv: list[int] = [r.window_ms, SLACK_MS]
            for idx, delta in r.deltas[-4:]:  # (the counters keep at most the current and previous window)
                argv += [idx, delta]
            if not r.deltas:
                argv += [0, 0]
            calls.append((SCRIPT, [r.key], argv))
        sent = self.clock() * 1000.0
        try:
            replies = await self.store.submit(calls, wait_s=SEND_WAIT_S)
        except LeaseholdError as e:
            log.debug("approximate counters: reconciliation of %d key(s) failed: %s", len(due), e)
            for r in due:
                self.counters.failed(r.key)
            return 0
        received = self.clock() * 1000.0
        ok = 0
        for r, reply in zip(due, replies, strict=True):
            if isinstance(reply, (list, tuple)) and len(reply) == 3:
                store_now, cur, prev = (int(x) for x in reply)
                self.store_clock.observe(sent, received, store_now)
                self.counters.reconciled(r.key, store_now, cur, prev)
                ok += 1
            else:
                self.counters.failed(r.key)
        return ok

    def _tick_s(self) -> float:
        shortest = min((kc.reconcile_ms for kc in self.counters.keys.values()), default=1000)
        return min(TICK_MAX_S, max(TICK_MIN_S, shortest / 4000.0))

    async def run(self) -> None:
        assert self._wake is not None
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._tick_s())
            self._wake.clear()
            try:
                await self.reconcile_once()
            except Exception:  # never let the loop die: the counters then only drift further
                log.exception("approximate counters: reconciliation round failed")

    def _ensure_running(self) -> None:
        if self._task is None and not self._closed:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self.run(), name="approx-reconcile")

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Stop reconciling; one last round (bounded) flushes what this process admitted."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            self._poke()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush(), SEND_WAIT_S)

    async def _flush(self) -> None:
        for kc in self.counters.keys.values():
            kc.due_ms = 0.0
        await self.reconcile_once()


__all__ = ["ApproxRules"]
