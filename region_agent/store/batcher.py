"""Coalesce concurrent script calls into shared pipelines.

Callers :meth:`Batcher.submit` a group of calls (the calls of one decision, or of a whole
batch request) and await their replies. One drain task sends everything queued as one
pipeline whenever the previous pipeline finished: no timer, so an idle agent adds no
latency and a busy one shares round trips. The queue is bounded; a full queue refuses
new work immediately (nothing sent) instead of queueing without bound (I10).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from allocator.contract.errors import AmbiguousOutcome, DeadlineExceeded, StoreUnavailable

ScriptCall = tuple[str, list, list]
RunPipeline = Callable[[Sequence[ScriptCall]], Awaitable[list[Any]]]


class _Entry:
    __slots__ = ("calls", "future", "sent")

    def __init__(self, calls: list[ScriptCall], future: asyncio.Future):
        self.calls = calls
        self.future = future
        self.sent = False


class Batcher:
    def __init__(self, run: RunPipeline, *, max_batch: int = 256, max_queue: int = 10_000,
                 on_batch: Callable[[int], None] | None = None):
        self._run = run
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._on_batch = on_batch
        self._queue: deque[_Entry] = deque()
        self._queued_calls = 0
        self._task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return self._queued_calls

    async def submit(self, calls: list[ScriptCall], *, wait_s: float | None = None) -> list[Any]:
        """Replies (or exception instances) for ``calls``, in order.

        Raises StoreUnavailable when the queue is full (nothing sent), DeadlineExceeded when
        ``wait_s`` passes before the calls were sent, AmbiguousOutcome when it passes after."""
        if not calls:
            return []
        if self._queued_calls + len(calls) > self._max_queue:
            raise StoreUnavailable("coalescing queue full", extra={"reason": "QUEUE_FULL"})
        entry = _Entry(list(calls), asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        self._queued_calls += len(calls)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        try:
            return await asyncio.wait_for(asyncio.shield(entry.future), wait_s)
        except TimeoutError:
            if not entry.sent:
                try:
                    self._queue.remove(entry)
                    self._queued_calls -= len(entry.calls)
                except ValueError:
                    pass
                raise DeadlineExceeded("decision deadline passed before the call was sent") from None
            raise AmbiguousOutcome("decision deadline passed after the call was sent") from None

    async def _drain(self) -> None:
        while self._queue:
            batch: list[_Entry] = []
            n = 0
            while self._queue and (not batch or n + len(self._queue[0].calls) <= self._max_batch):
                e = self._queue.popleft()
                e.sent = True
                batch.append(e)
                n += len(e.calls)
            self._queued_calls -= n
            if self._on_batch is not None:
                self._on_batch(n)
            flat = [c for e in batch for c in e.calls]
            try:
                replies = await self._run(flat)
            except Exception as exc:  # the whole pipeline failed: every caller gets the error
                for e in batch:
                    if not e.future.done():
                        e.future.set_exception(exc)
                continue
            i = 0
            for e in batch:
                part = replies[i:i + len(e.calls)]
                i += len(e.calls)
                if not e.future.done():
                    e.future.set_result(part)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(self._task, 1.0)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
