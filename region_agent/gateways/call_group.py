"""RLS calls that arrive together are decided together.

grpcio's asyncio server accepts one call at a time: each accept is a round trip from its poller
thread into the event loop, queued behind every other callback the loop runs. Under load the calls
therefore reach the door one by one, and each would be a decision of its own: its own coroutine
chain through the admission and the engine, its own entry in the store's batcher, pipelines of
1.5 calls on average at 64 calls in flight (against 6-16 for ``POST /v1/admit`` at the same
concurrency). A decision made alone costs the agent two to three times the CPU of one made with
others (``python -m bench.rls_overhead`` with 1 task against 64).

:class:`CallGroup` holds the questions of a call that arrives while other calls are in flight for
at most ``linger_s`` (or until ``size`` questions wait), then asks the admission once for the
whole group, as ``POST /v1/admit/batch`` does (one plan per question from the bundle's precomputed
shapes, one coalesced pipeline), and hands every call its own decisions. A call that arrives alone
(an idle or lightly loaded agent) never waits and is decided as before.

A group is an optimisation, never a change of answer: each question gets the decision it would
get alone (the admission's batch path is the same decision per question, in order). When the
group's decision raises (a question the engine refuses, an agent still starting, anything else),
each call is decided alone, so a call fails only for its own question.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..models import AdmitRequest, Decision

Decide = Callable[[list[AdmitRequest]], Awaitable[list[Decision]]]


class CallGroup:
    __slots__ = ("_count", "_decide", "_in_flight", "_loop", "_on_group", "_running", "_timer", "_waiting",
                 "linger_s", "size")

    def __init__(self, decide: Decide, linger_s: float, size: int = 32,
                 on_group: Callable[[int], None] | None = None):
        self._decide = decide  # the admission, for the questions of several calls at once
        self._on_group = on_group  # told the number of calls of each group decided (a metric)
        self.linger_s = linger_s  # 0: never hold a call
        self.size = max(1, size)  # a group of this many questions goes at once (the batcher's pipeline size)
        self._in_flight = 0
        self._waiting: list[tuple[list[AdmitRequest], asyncio.Future]] = []
        self._count = 0  # questions waiting
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, while a group waits or is decided

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> bool:
        """A call arrives; True when other calls are in flight (it may join a group). Every
        ``enter`` is matched by one :meth:`leave`."""
        self._in_flight += 1
        return self._in_flight > 1 and self.linger_s > 0

    def leave(self) -> None:
        """The call is answered (or failed, or was cancelled)."""
        self._in_flight -= 1

    def decide(self, questions: list[AdmitRequest]) -> asyncio.Future[list[Decision]]:
        """The decisions of one call's ``questions``, made with the group it joins: a future to
        await (no coroutine of its own: one frame less per call)."""
        # the loop this group's linger timer and tasks run on; asked again when none is armed or
        # running (get_running_loop is a getpid() system call on Python 3.11, as in Batcher.enqueue)
        loop = self._loop if self._timer is not None or self._running else None
        if loop is None or loop.is_closed():
            loop = asyncio.get_running_loop()
            if loop is not self._loop:  # another event loop: the last one's linger timer never fires here
                self._loop, self._timer = loop, None
                self._waiting, self._count = [], 0
        mine: asyncio.Future[list[Decision]] = loop.create_future()
        self._waiting.append((questions, mine))
        self._count += len(questions)
        if self._count >= self.size:
            self.release()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger_s, self.release)
        return mine

    def release(self) -> None:
        """Decide the waiting group now (the linger's timer; also when the group is full)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = [(q, f) for q, f in self._waiting if not f.done()]  # a cancelled caller: nothing to decide
        self._waiting, self._count = [], 0
        if waiting:
            # the loop of decide(), which queued them (the linger's timer runs on it too)
            task = waiting[0][1].get_loop().create_task(self._run(waiting))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, waiting: list[tuple[list[AdmitRequest], asyncio.Future]]) -> None:
        if self._on_group is not None:
            self._on_group(len(waiting))
        if len(waiting) == 1:
            await self._alone(*waiting[0])
            return
        try:
            decisions = await self._decide([q for qs, _ in waiting for q in qs])
        except Exception:  # some call's question the engine refused (or worse): each call decided alone
            await asyncio.gather(*(self._alone(qs, f) for qs, f in waiting))
            return
        except BaseException as e:  # cancelled (the server stopping): so are the calls waiting for it
            for _, f in waiting:
                if not f.done():
                    f.set_exception(e)
            raise
        i = 0
        for qs, f in waiting:
            if not f.done():
                f.set_result(decisions[i:i + len(qs)])
            i += len(qs)

    async def _alone(self, questions: list[AdmitRequest], mine: asyncio.Future) -> None:
        try:
            got = await self._decide(questions)
        except Exception as e:
            if not mine.done():
                mine.set_exception(e)
        else:
            if not mine.done():
                mine.set_result(got)


__all__ = ["CallGroup"]
