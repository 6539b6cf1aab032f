"""How late this process's event loop runs its callbacks — the agent's own saturation.

A decision that does not get its store answer within its budget has one of two causes: the
store stopped answering (Redis hung, a network fault), or this agent is too busy to read the
answer that is already there (a CPU-saturated event loop, a burst). Only the first is a store
failure that may degrade to the local fallback; the second is overload (region_agent README).

``LoopLag`` ticks every ``interval_s`` and records how late each tick ran; ``lag_s(now)`` is the
worst lateness over the last ``window_s`` — including the tick that is overdue right now, which
a saturated loop has not run yet. Pure apart from :meth:`run` (the clock is passed in).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopLag:
    def __init__(self, interval_s: float = 0.005, window_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.window_s = window_s
        self.clock = clock
        self._due = clock() + interval_s  # when the next tick should run
        self._worst: list[tuple[float, float]] = []  # (tick time, lateness), newest last, within window_s
        self.running = False  # only a running monitor has a tick that can be overdue

    def tick(self, now: float) -> None:
        late = max(0.0, now - self._due)
        self._worst = [(t, x) for t, x in self._worst if now - t <= self.window_s and x > late]
        self._worst.append((now, late))
        self._due = now + self.interval_s

    def lag_s(self, now: float) -> float:
        recent = max((x for t, x in self._worst if now - t <= self.window_s), default=0.0)
        return max(recent, now - self._due) if self.running else recent

    async def run(self) -> None:
        self._due = self.clock() + self.interval_s
        self.running = True
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.tick(self.clock())
        finally:
            self.running = False
