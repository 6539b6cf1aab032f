"""The leader's write queue and its committer: group commit in a pipeline.

Every write (a grant or a usage report) is queued as an :class:`Item`; one committer task groups
what is queued into *units* (:func:`allocator.grouping.form_units`: pools exclusive, queue order
per pool, one epoch per shard, etcd's op and byte limits) and runs up to ``TXNS_IN_FLIGHT`` of
them at once, each one etcd transaction (``run_unit``, the transaction loop of
:mod:`allocator.transactions`), so Python decides the next while etcd commits one.

Callers wait on one future per request or batch (:class:`Wait`), not one per item. The writes
accepted for each shard and not answered yet are counted (:class:`OpenWrites`): a handoff of the
shard waits for them (:meth:`OpenWrites.drain`, given to the election in its constructor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from kernel import tracing
from kernel.errors import LeaseholdError, Unavailable

from .grouping import WINDOW_BYTES, Unit, form_units

log = logging.getLogger(__name__)

TXNS_IN_FLIGHT = 4  # units (transactions) the committer runs at once, on disjoint pools
BUSY_MIN_UNIT = 64  # while a unit is in flight, another starts only with this many writes queued
MIN_UNIT = 128  # what is queued is spread over the free slots, no unit smaller than this: bigger transactions cost
# etcd and us less per grant, two or more in flight let Python and etcd work side by side (bench/README.md)
MAX_TXN_BYTES = 1_000_000  # estimated request size per transaction: below etcd's default --max-request-bytes (1.5 MiB)
MIN_TXN_BYTES = 64_000
MAX_QUEUE = 16_384  # queued writes; beyond this the leader sheds load with a retriable 503


class Wait:
    """One caller's wait: a request or a whole batch. One future, set when its last item is answered
    (no future, callback or task per item)."""

    __slots__ = ("fut", "open")

    def __init__(self) -> None:
        self.fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.open = 0

    def one_done(self) -> None:
        self.open -= 1
        if self.open == 0 and not self.fut.done():
            self.fut.set_result(None)

    async def wait(self) -> None:
        if self.open:
            await self.fut


class Item:
    """A grant request on its way through the committer (a :class:`allocator.grouping.Queued`)."""

    __slots__ = ("req", "wait", "shard", "epoch", "pool", "window_choice", "result", "error", "done", "joiners",
                 "trace")
    is_grant = True

    def __init__(self, req: Any, wait: Wait, shard: int, epoch: int):
        self.req = req  # a LeaseRequest (a UsageReport for a ReportItem)
        self.wait = wait
        self.shard = shard
        self.epoch = epoch  # the epoch this replica led the pool's shard with when it accepted the request
        self.pool: str = req.pool
        # the window the grant asks for ("current"/"next"; a report: ""), read twice per item by grouping
        self.window_choice: str = self._window_choice(req)
        self.result: Any = None
        self.error: LeaseholdError | None = None
        self.done = False
        self.joiners: list[Item] = []  # requests for the same lease id that arrived while this one was queued
        self.trace = tracing.current_context() if tracing.ENABLED else None  # its request's span (a commit links it)
        wait.open += 1

    @staticmethod
    def _window_choice(req: Any) -> str:
        return str(req.window)

    @property
    def lease_id(self) -> str:
        return str(self.req.lease_id)

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class ReportItem(Item):
    """A usage report on its way through the committer."""

    __slots__ = ()
    is_grant = False

    @staticmethod
    def _window_choice(req: Any) -> str:
        return ""


class OpenWrites:
    """Writes accepted per shard and not answered yet; a handoff drains a shard's."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}  # set when a drained shard's last write is answered

    def opened(self, shard: int) -> None:
        self._open[shard] = self._open.get(shard, 0) + 1

    def closed(self, shard: int) -> None:
        left = self._open[shard] = self._open[shard] - 1
        if not left and (idle := self._idle.pop(shard, None)) is not None:
            idle.set()

    async def drain(self, shard: int) -> None:
        """Wait until every write accepted for ``shard`` has been answered (a handoff calls this
        after it stopped accepting the shard, with its own time bound)."""
        while self._open.get(shard):
            await self._idle.setdefault(shard, asyncio.Event()).wait()


class Committer:
    """The queue and the task that turns it into transactions. ``run_unit(unit)`` commits one
    unit (every item answered when it returns); ``answer(item, result, error)`` settles one."""

    def __init__(self, run_unit: Callable[[Unit[Item]], Awaitable[None]], open_writes: OpenWrites,
                 max_ops: Callable[[], int]):
        self._run_unit = run_unit
        self.open_writes = open_writes
        self._max_ops = max_ops  # etcd's --max-txn-ops as the store knows it now
        self._ready: deque[Item] = deque()  # queued, in arrival order
        self._wakeup: asyncio.Future[None] | None = None  # the committer's sleep
        self._running: dict[asyncio.Task[None], Unit[Item]] = {}
        self._busy: set[str] = set()  # pools of the units in flight
        self._inflight: dict[tuple[str, str], Item] = {}  # (region, lease id) -> its queued grant (a retry joins it)
        # pool -> size of its last window record and key as encoded (unit budgets), set by the transactions
        self.window_bytes: dict[str, int] = {}
        self.txn_bytes = MAX_TXN_BYTES
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="allocator-committer")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        while self._ready:
            self.answer(self._ready.popleft(), error=Unavailable("allocator shutting down"))

    # -- queue ----------------------------------------------------------------------------------
    def queued_grant(self, region: str, lease_id: str) -> Item | None:
        """The grant queued for this lease id, if one is (a retry joins it)."""
        return self._inflight.get((region, lease_id))

    def check_backlog(self) -> None:
        if len(self._ready) >= MAX_QUEUE:
            raise Unavailable(f"allocator leader overloaded ({MAX_QUEUE} writes queued); retry shortly")

    def queue(self, item: Item) -> None:
        if item.is_grant:
            self._inflight[(item.req.region, item.req.lease_id)] = item
        self.open_writes.opened(item.shard)
        self._ready.append(item)
        self._wake()

    def requeue(self, items: list[Item]) -> None:
        """Items of a transaction etcd refused for its size: first in the queue again, in order."""
        self._ready.extendleft(reversed([it for it in items if not it.done]))

    def answer(self, item: Item, result: Any = None, error: LeaseholdError | None = None) -> None:
        """Settle a queued item (once) and the requests that joined it."""
        if item.done:
            return
        item.done, item.result, item.error = True, result, error
        item.wait.one_done()
        for it in item.joiners:
            it.done, it.result, it.error = True, result, error
            it.wait.one_done()
        if item.is_grant:
            key = (item.req.region, item.req.lease_id)
            if self._inflight.get(key) is item:
                del self._inflight[key]
        self.open_writes.closed(item.shard)

    def lower_txn_bytes(self, refused_bytes: int) -> None:
        """etcd refused a transaction of ``refused_bytes`` for its size: build smaller ones."""
        lowered = max(MIN_TXN_BYTES, min(self.txn_bytes, refused_bytes) // 2)
        if lowered < self.txn_bytes:
            log.error("etcd refused a transaction of %d bytes (its --max-request-bytes): using %d bytes "
                      "per transaction from now on", refused_bytes, lowered)
        self.txn_bytes = lowered

    # -- the committer task ---------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            running = len(self._running)
            free = TXNS_IN_FLIGHT - running
            units: list[Unit[Item]] = []
            # group commit: with a transaction in flight, a few queued writes wait for it to finish
            # and go out together (one transaction for many single requests); enough of them to
            # fill a transaction go out at once, so etcd and Python work side by side
            if self._ready and free > 0 and (not running or len(self._ready) >= BUSY_MIN_UNIT):
                per_unit = max(MIN_UNIT, -(-len(self._ready) // free))
                units, left = form_units(self._ready, busy=self._busy, free=free, per_unit=per_unit,
                                         max_ops=self._max_ops(), max_bytes=self.txn_bytes,
                                         window_bytes=self._window_size)
                self._ready = deque(left)
                for unit in units:
                    task = loop.create_task(self._traced(unit))
                    self._running[task] = unit
                    self._busy |= unit.pools
                    task.add_done_callback(self._unit_done)
            if not units:  # nothing queued, no free slot, or every queued pool busy: wait for a change
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None

    def _window_size(self, pool: str) -> int:
        return self.window_bytes.get(pool, WINDOW_BYTES)

    def _unit_done(self, task: asyncio.Task[None]) -> None:
        unit = self._running.pop(task)
        self._busy -= unit.pools
        self._wake()

    async def _traced(self, unit: Unit[Item]) -> None:
        traces = [it.trace for it in unit.items if it.trace is not None] if tracing.ENABLED else []
        if not traces:
            return await self._run_unit(unit)
        # one transaction for requests of several traces: the first request's span is its parent,
        # every request's span is linked
        with tracing.span("leasehold.allocator_commit", parent=traces[0], links=traces,
                          attributes={"leasehold.kind": "grants" if unit.is_grant else "reports",
                                      "leasehold.items": len(unit.items),
                                      "leasehold.pools": sorted(unit.pools)}):
            await self._run_unit(unit)
