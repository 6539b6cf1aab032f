"""RLS calls that arrive together are decided together.

grpcio's asyncio server accepts one call at a time: each accept is a round trip from its poller
thread into the event loop, queued behind every other callback the loop runs. Under load the calls
therefore reach the admission one by one, and each would pay a Redis pipeline of its own (1.5
calls per pipeline at 64 calls in flight, against 6-16 for ``POST /v1/admit`` at the same
concurrency); a decision alone in its pipeline costs the agent two to three times the CPU of one
in a full pipeline (``python -m leasehold.bench.rls_overhead`` with 1 task against 64).

:class:`CallGroup` holds a call that arrives while other calls are in flight for at most
``linger_s`` (or until ``size`` calls wait), then lets the whole group go in one turn of the
loop: their decisions enter the store's batcher together and leave in one pipeline. A call that
arrives alone (an idle or lightly loaded agent) never waits. Pure asyncio, no I/O.
"""

from __future__ import annotations

import asyncio


class CallGroup:
    __slots__ = ("_in_flight", "_timer", "_waiting", "linger_s", "size")

    def __init__(self, linger_s: float, size: int = 32):
        self.linger_s = linger_s  # 0: never hold a call
        self.size = max(1, size)  # a group this large goes at once (the batcher's pipeline size)
        self._in_flight = 0
        self._waiting: list[asyncio.Future] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> asyncio.Future | None:
        """A call arrives: ``None`` when it goes at once, else a future to await (the group's
        start). Every ``enter`` is matched by one :meth:`leave`."""
        self._in_flight += 1
        if self._in_flight == 1 or self.linger_s <= 0:
            return None
        loop = asyncio.get_running_loop()
        wait = loop.create_future()
        self._waiting.append(wait)
        if len(self._waiting) >= self.size:
            self.release()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger_s, self.release)
        return wait

    def leave(self) -> None:
        """The call is answered (or failed, or was cancelled)."""
        self._in_flight -= 1

    def release(self) -> None:
        """Let every waiting call go now (the timer's callback; also when the group is full)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        for wait in waiting:
            if not wait.done():  # a caller cancelled while it waited: nothing to start
                wait.set_result(None)


__all__ = ["CallGroup"]
