"""Coalesce concurrent script calls into shared pipelines.

Callers :meth:`Batcher.enqueue` a group of calls (the calls of one decision, or of a whole
batch request) and await their replies. Up to ``max_inflight`` drain tasks each send what
is queued (at most ``max_batch`` calls, or one larger group whole) as one pipeline and take
the next when it comes back: no timer, so an idle agent adds no latency and a busy one
shares round trips. More than one pipeline in flight lets the agent's Python work on the
next decisions while Redis runs the previous pipeline (in lockstep, one of the two always
waits: measured +25-30 % decisions/s in process with 3 x 32 over 1 x 64). The queue is
bounded; a full queue refuses new work immediately (nothing sent) instead of queueing
without bound (I10).

A caller's wait has two phases: ``wait_s`` until its calls are answered, and — only when they
were already sent when ``wait_s`` passed — as long as ``late_s(elapsed)`` keeps allowing (asked
again after each slice it returns; 0: give up) for the pipeline's own answer. The batcher also reports how long its oldest pipeline has been in flight,
which tells a store that stopped answering from an agent too busy to read the answer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from kernel.errors import AmbiguousOutcome, DeadlineExceeded, LeaseholdError, Overloaded

from ..decision.call import ScriptCall

RunPipeline = Callable[[Sequence[ScriptCall]], Awaitable[list[Any]]]


class _Entry(msgspec.Struct, eq=False):
    """One caller's group of calls (one per decision: made by msgspec's constructor, in C). Equal
    only to itself, as before (the deque's ``remove`` of a withdrawn entry compares no fields)."""

    calls: list[ScriptCall]
    future: asyncio.Future
    late_s: Callable[[float], float] | None
    sent: bool = False
    deadline: float = 0.0  # loop time the caller's wait ends (when it is in the deadline queue)
    timer: asyncio.TimerHandle | None = None  # a deadline of its own, then each late slice


class Batcher:
    def __init__(self, run: RunPipeline, *, max_batch: int = 32, max_queue: int = 10_000,
                 on_batch: Callable[[int], None] | None = None, max_inflight: int = 3,
                 on_timeout: Callable[[LeaseholdError], BaseException] | None = None):
        """``on_timeout``: what a caller whose wait ended gets instead of the DeadlineExceeded
        or AmbiguousOutcome (the Redis node judges the store by it: RedisNode.submit)."""
        self._run = run
        self._on_timeout = on_timeout
        self._max_inflight = max(1, max_inflight)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the running loop, while a drain task runs
        self._starting = False  # a drain task was created and has not run yet
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._on_batch = on_batch
        self._queue: deque[_Entry] = deque()
        self._queued_calls = 0
        self._sent_at: dict[int, float] = {}  # in-flight pipeline -> loop time it was handed to the store
        self._deadlines: deque[_Entry] = deque()  # groups waiting under a deadline, earliest first
        self._sweep: asyncio.TimerHandle | None = None  # armed for the earliest unanswered deadline

    @property
    def queued(self) -> int:
        return self._queued_calls

    def oldest_in_flight(self, now: float) -> float | None:
        """Seconds the oldest pipeline still in flight has waited for its answer (None: none)."""
        return now - min(self._sent_at.values()) if self._sent_at else None

    def enqueue(self, calls: list[ScriptCall], *, wait_s: float | None = None,
                late_s: Callable[[float], float] | None = None) -> asyncio.Future:
        """A future of the replies (or exception instances) for ``calls``, in order; no coroutine of
        its own (a caller on the hot path awaits the future it returns).

        Raises Overloaded at once when the queue is full (nothing sent); the future raises
        DeadlineExceeded when ``wait_s`` passes before the calls were sent, AmbiguousOutcome when it
        passes after and the late wait (``late_s(seconds already waited late)`` -> the next slice,
        0 = stop) ends too. A caller cancelled while it waits cancels the future; a cancelled group
        still queued is dropped unsent."""
        # the loop the drain tasks and the deadline sweep run on; asked again when neither is running
        # or armed (get_running_loop is a getpid() system call on Python 3.11: a measurable part of a
        # decision)
        loop = self._loop if self._tasks or self._sweep is not None else None
        if loop is None or loop.is_closed():
            loop = asyncio.get_running_loop()
            if loop is not self._loop:  # another event loop: the last one's deadline timer never fires here
                self._loop, self._sweep = loop, None
                self._deadlines.clear()
        future = loop.create_future()
        if not calls:
            future.set_result([])
            return future
        if self._queued_calls + len(calls) > self._max_queue:
            raise Overloaded("coalescing queue full", extra={"reason": "QUEUE_FULL"})
        entry = _Entry(calls, future, late_s)  # not copied: the caller does not change a list it submitted
        self._queue.append(entry)
        self._queued_calls += len(calls)
        if not self._starting and len(self._tasks) < self._max_inflight:
            # every drain task is busy with a pipeline (or there is none): start one more; it takes
            # everything queued by the time it runs, so a burst of submits starts only one
            self._starting = True
            task = loop.create_task(self._drain(loop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if wait_s is not None:
            # no asyncio.timeout + shield around the wait, and no timer per group (creating and
            # cancelling one was a twentieth of a decision's CPU): the groups wait in deadline order
            # in one queue, and one timer armed for the earliest unanswered deadline expires them
            # (_expire_due). A group whose deadline is earlier than the last one queued (another
            # budget) gets a timer of its own. Each late slice is a timer too (_late).
            at = loop.time() + wait_s
            due = self._deadlines
            if not due or at >= due[-1].deadline:
                entry.deadline = at
                due.append(entry)
                if self._sweep is None:
                    self._sweep = loop.call_at(at, self._expire_due, loop)
            else:
                entry.timer = loop.call_later(wait_s, self._expire, entry)
        return future

    def _expire_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Expire the queued groups whose deadline passed; drop the answered ones at the front;
        arm the timer again for the first one still waiting. Answered groups are dropped as the
        front reaches them, so the timer fires about once per budget, not once per decision.
        ``loop``: the loop the timer was armed on, which runs it."""
        self._sweep = None
        now = loop.time()
        due = self._deadlines
        while due:
            entry = due[0]
            if entry.future.done():
                due.popleft()
                continue
            if entry.deadline > now:
                self._sweep = loop.call_at(entry.deadline, self._expire_due, loop)
                return
            due.popleft()
            self._expire(entry)

    def _expire(self, entry: _Entry) -> None:
        """The caller's ``wait_s`` passed: not sent yet -> DeadlineExceeded (never sent); sent ->
        wait in late slices while ``late_s`` allows (:meth:`_late`)."""
        if entry.future.done():
            return
        if self._withdraw(entry):
            entry.future.set_exception(self._timed_out(DeadlineExceeded("decision deadline passed before the call was sent")))
            return
        self._late(entry, entry.future.get_loop().time())  # (the loop running this: the caller's)

    def _late(self, entry: _Entry, late_from: float) -> None:
        if entry.future.done():
            return
        loop = entry.future.get_loop()
        more = entry.late_s(loop.time() - late_from) if entry.late_s is not None else 0.0
        if more <= 0:
            entry.future.set_exception(self._timed_out(AmbiguousOutcome("decision deadline passed after the call was sent")))
            return
        entry.timer = loop.call_later(more, self._late, entry, late_from)

    def _timed_out(self, exc: LeaseholdError) -> BaseException:
        return exc if self._on_timeout is None else self._on_timeout(exc)

    def _withdraw(self, entry: _Entry) -> bool:
        """Take a not-yet-sent entry out of the queue; False if it was already sent."""
        if entry.sent:
            return False
        try:
            self._queue.remove(entry)
            self._queued_calls -= len(entry.calls)
        except ValueError:
            pass
        return True

    async def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send what is queued, pipeline after pipeline; ``loop``: the loop running this task."""
        self._starting = False
        while self._queue:
            batch: list[_Entry] = []
            n = 0
            while self._queue and (not batch or n + len(self._queue[0].calls) <= self._max_batch):
                e = self._queue.popleft()
                if e.future.done():  # its caller was cancelled before it was sent: nobody waits for it
                    self._queued_calls -= len(e.calls)
                    _stop(e)
                    continue
                e.sent = True
                batch.append(e)
                n += len(e.calls)
            self._queued_calls -= n
            if not batch:
                continue
            if self._on_batch is not None:
                self._on_batch(n)
            flat = [c for e in batch for c in e.calls]
            token = id(batch)
            self._sent_at[token] = loop.time()
            try:
                replies = await self._run(flat)
            except Exception as exc:  # the whole pipeline failed: every caller gets the error
                for e in batch:
                    _stop(e)
                    if not e.future.done():
                        e.future.set_exception(exc)
                        e.future.exception()  # retrieved here: a caller that gave up awaits it no more
                continue
            finally:
                self._sent_at.pop(token, None)
            i = 0
            for e in batch:  # (_stop inline: once per decision)
                k = i + len(e.calls)
                part = replies[i:k]
                i = k
                if e.timer is not None:
                    e.timer.cancel()
                future = e.future
                if not future.done():
                    future.set_result(part)

    async def close(self) -> None:
        for task in list(self._tasks):
            try:
                await asyncio.wait_for(task, 1.0)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


def _stop(entry: _Entry) -> None:
    """Cancel the entry's pending timer (its deadline or late slice): it is answered or dropped."""
    if entry.timer is not None:
        entry.timer.cancel()
