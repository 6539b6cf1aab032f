"""The agent's adapter to one Redis node: sends script calls through the coalescing
:class:`Batcher` under the node's circuit breaker, and translates driver errors into
``kernel.errors``.

A standalone Redis (or the primary a Sentinel names) is one :class:`RedisNode`; a Redis
Cluster is one per primary behind :class:`region_agent.store.cluster.ClusterStore`, so a
failing primary opens only its own breaker. Everything Redis-specific the decision engine
needs goes through these two classes (the :class:`~region_agent.store.protocol.Store` protocol)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from kernel.errors import (
    AmbiguousOutcome,
    LeaseholdError,
    Overloaded,
    StoreUnavailable,
)
from kernel.ratelog import TransitionLog

from ..decision.call import ScriptCall
from . import redis_internals as ri
from . import scripts as sc
from .batcher import Batcher
from .breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from .lag import LoopLag

log = logging.getLogger(__name__)

INFO_SECTIONS = ("memory", "stats", "clients", "replication", "keyspace", "commandstats")


def translate(exc: BaseException, *, sent: bool = True) -> LeaseholdError:
    """Driver error -> contract error (the scripts module's one translation)."""
    return sc.translate_redis_error(exc, sent=sent)


class RedisNode:
    """``stall_s``: a pipeline in flight longer than this (the decision budget) while the event
    loop runs on time means the store stopped answering; ``late_s``: how long a call already sent
    may wait past its caller's budget for its own answer when the store is not stalled (the
    socket timeout bounds it anyway). See :meth:`submit`."""

    cluster = False  # one node: every key is on it (region_agent.store.cluster.ClusterStore is the cluster)

    def __init__(self, client: Any, scripts: sc.Scripts, *, max_batch: int = 32, max_queue: int = 10_000,
                 max_inflight: int = 3, on_batch=None, breaker: CircuitBreaker | None = None, on_breaker=None,
                 stall_s: float = 0.05, late_s: float = 0.5, lag: LoopLag | None = None,
                 connect_timeout_s: float = 0.25, log_interval_s: float = 10.0, name: str = "redis",
                 shard: str = "default", on_reachability=None):
        """``on_breaker(state)``: after every verdict on the node (the breaker gauge);
        ``on_reachability(reachable)``: when an outage begins (the breaker opened from closed) and
        when it ends (closed again) — not on every half-open probe in between."""
        self.client = client
        self.shard = shard  # the name of this node in metrics and store health
        self.scripts = scripts
        self.scripts_loaded = False
        self.batcher = Batcher(self._run_pipeline, max_batch=max_batch, max_queue=max_queue,
                               max_inflight=max_inflight, on_batch=on_batch, on_timeout=self._timed_out)
        self.breaker = breaker or CircuitBreaker()
        self.on_breaker = on_breaker
        self.on_reachability = on_reachability
        self.stall_s = stall_s
        self.late_s = late_s
        self.connect_timeout_s = connect_timeout_s
        self.lag = lag or LoopLag()
        self._lag_task: asyncio.Task | None = None
        self._reading: dict[int, Any] = {}  # standalone pipelines awaiting replies: (connection, sent at)
        # the connections the batcher's drain tasks keep between pipelines (one each at most): no pool
        # checkout per pipeline (None: a client that is not redis-py's, or whose pool must see each use)
        self._held = ri.HeldConnections.of(client, max(1, max_inflight))
        self.name = name
        # one line per reachability change (breaker opened / closed again), at most one per interval
        self.reachability = TransitionLog(log, initial=True, interval_s=log_interval_s)
        self._opened_at = 0.0
        self._told: int | None = None  # the breaker state last given to on_breaker
        # the last store failure when the store refused the command (OOM, ACL, credentials): it stays
        # until an operator acts, so the outage's log line names it
        self._refused: sc.StoreRefused | None = None

    def start(self) -> None:
        """Start measuring the event loop's lag (call inside the running loop)."""
        if self._lag_task is None:
            self._lag_task = asyncio.get_running_loop().create_task(self.lag.run(), name="loop-lag")

    def stalled(self) -> bool:
        """The store stopped answering: a pipeline was *sent* (its bytes written), or a new
        connection's handshake started, more than ``stall_s`` ago, and no answer bytes wait unread
        on any connection being read — time spent before that (a busy loop, the queue) is this
        agent's own. Otherwise a late answer is this agent's saturation (overload), not a store failure."""
        now = time.monotonic()
        reading = list(self._reading.values())
        if not reading:
            return False
        age = now - min(sent for _, sent in reading)
        if age <= self.stall_s or self.lag.lag_s(now) >= age / 2:
            return False
        return not any(conn is not None and ri.answer_waiting(conn) for conn, _ in reading)

    def _own_timeout(self, r: Any) -> Any:
        """A driver timeout (connecting, or reading a reply) while this process's event loop lags
        by a quarter of that timeout or more is this agent's saturation, not the store's failure:
        ``Overloaded`` (shed; the script may have run, so nothing is admitted on it)."""
        if not (isinstance(r, (StoreUnavailable, AmbiguousOutcome)) and r.extra.get("cause") == "timeout"):
            return r
        # (NothingRan timed out reading a reply, its handshake's or its reload's: judged as a sent call)
        timeout = self.connect_timeout_s if r.__class__ is StoreUnavailable else self.late_s
        if self.lag.lag_s(time.monotonic()) >= timeout / 4:
            return Overloaded("a store call timed out while this agent was saturated")
        return r

    async def warm(self, connections: int) -> None:
        """Open ``connections`` pooled connections now, so a burst does not have to connect (a
        connect under a saturated event loop can time out and look like a store failure)."""
        pool = self.client.connection_pool
        conns = []
        try:
            for _ in range(connections):
                conn = await pool.get_connection()
                conns.append(conn)
                await conn.connect()
        except Exception:  # the store is down: readiness and the decisions say so
            pass
        finally:
            for conn in conns:
                await pool.release(conn)

    def _late_wait(self, waited_s: float) -> float:
        """The next slice a sent call may wait past its caller's budget: none once the store looks
        stalled or ``late_s`` is used up; re-checked every half ``stall_s``."""
        if waited_s >= self.late_s or self.stalled():
            return 0.0
        return min(self.late_s - waited_s, max(0.005, self.stall_s / 2))

    async def load(self) -> None:
        try:
            await self.scripts.load_all(self.client)
        except Exception as e:
            self.scripts_loaded = False
            raise translate(e, sent=False) from None
        self.scripts_loaded = True

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except Exception:
            return False

    async def info(self) -> dict[str, Any]:
        """The ``INFO`` sections store health reads, parsed by redis-py (region_agent.service.store_health)."""
        return await self.client.info(*INFO_SECTIONS)

    def info_readers(self) -> dict[str, Any]:
        """Per shard (this node's name: ``default`` for a standalone Redis), how to read its INFO."""
        return {self.shard: self.info}

    def shard_of(self, key: str) -> str:
        """The shard owning ``key``: this node."""
        return self.shard

    async def _run_pipeline(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """One pipeline (called by the batcher's drain task). Its outcome is what judges the
        store for the breaker: a pipeline that came back without store errors in time closes it
        (:meth:`_slower_than_a_decision`), one that failed counts against it. Callers whose own deadline passed first do not decide that:
        on a CPU-saturated agent the reply can be late only because the event loop was busy, and
        an agent that opened its breaker on that would serve fallback decisions while Redis is fine."""
        started = time.monotonic()
        try:  # (the NOSCRIPT reload and re-run are run_pipeline's)
            replies = await self.scripts.run_pipeline(self.client, calls, self._reading, self._held)
        except Exception as e:
            err = self._own_timeout(translate(e))
            if not isinstance(err, Overloaded):
                self._refused = err if isinstance(err, sc.StoreRefused) else None
                self.breaker.failure(time.monotonic())
                self._breaker_changed()
            raise err from None
        failed = False
        if sc.has_error(replies):  # one pass over the replies in the common case (no error among them)
            replies = [self._own_timeout(r) for r in replies]
            # MOVED / ASK / TRYAGAIN came from a healthy node that said where its slot is (or that it moves)
            failures = [r for r in replies if isinstance(r, (StoreUnavailable, AmbiguousOutcome))
                        and not isinstance(r, sc.SlotRedirect)]
            if failures:
                failed = True
                self._refused = next((r for r in failures if isinstance(r, sc.StoreRefused)), None)
        if failed:
            self.breaker.failure(time.monotonic())
        elif self.breaker.state == HALF_OPEN or not self._slower_than_a_decision(started):
            self.breaker.success()
        self._breaker_changed()
        return replies

    def _slower_than_a_decision(self, started: float) -> bool:
        """The store answered this pipeline, but later than a decision may wait (``stall_s``, the
        decision budget) while this agent's loop ran on time: its callers were already answered
        degraded (each counted against the store by :meth:`_timed_out`). Such an answer neither
        closes the breaker nor clears its count — else a store that is slow on every call (a
        saturated or distant Redis answering in 100-400 ms) would never open it, and every
        decision would wait out its budget before degrading while its script still ran in Redis.
        A probe's answer (half-open) closes it as always."""
        now = time.monotonic()
        elapsed = now - started
        return elapsed > self.stall_s and self.lag.lag_s(now) < elapsed / 2

    def submit(self, calls: list[ScriptCall], *, wait_s: float | None) -> Awaitable[list[Any]]:
        """Send ``calls`` through the coalescing batcher, guarded by the shard's breaker: while
        it is open nothing is sent and the caller degrades at once (``StoreUnavailable``).

        The caller's budget ``wait_s`` passing is judged by what the store is doing (:meth:`stalled`,
        in :meth:`_timed_out`):

        * not sent yet — a stalled store: ``StoreUnavailable`` (the caller degrades, the breaker
          counts it); otherwise this agent is overloaded: ``Overloaded`` (the caller sheds);
        * sent — the call keeps waiting for its own answer while the store does not look stalled
          (re-checked as it waits), at most ``late_s`` more: a late answer is a right answer, and
          no local allowance is spent because the agent was busy; once the store looks stalled:
          ``AmbiguousOutcome`` (degrade).

        A full queue is overload too (``Overloaded``). Overload never counts against the store.
        A pipeline that failed as a whole counts once against the store (:meth:`_run_pipeline`),
        not once more per caller that was waiting on it.
        With the breaker closed the caller awaits the batcher's future itself (no coroutine
        here: this is every decision's path); a half-open probe goes through :meth:`_probe`,
        which gives the probe back when its call ends without a verdict on the store."""
        br = self.breaker
        if br.state == CLOSED:  # (allow() lets every call through while closed)
            return self.batcher.enqueue(calls, wait_s=wait_s, late_s=self._late_wait)
        if not br.allow(time.monotonic()):
            self._breaker_changed()
            raise StoreUnavailable("circuit breaker open")
        return self._probe(calls, wait_s)  # half-open: this call is a probe

    async def _probe(self, calls: list[ScriptCall], wait_s: float | None) -> list[Any]:
        try:
            return await self.batcher.enqueue(calls, wait_s=wait_s, late_s=self._late_wait)
        except AmbiguousOutcome:
            raise  # counted against the store by _timed_out: the probe's verdict
        except BaseException:
            # the wait passed before the send (_timed_out judged it), overload (queue full), another
            # contract error, or the caller cancelled: the half-open probe is given back
            self.breaker.release_probe()
            raise

    def _timed_out(self, exc: LeaseholdError) -> BaseException:
        """What a caller whose budget passed gets (the batcher's ``on_timeout``): see :meth:`submit`."""
        if isinstance(exc, AmbiguousOutcome):
            # sent and not answered while the store looks stalled (or even after the late wait):
            # counts against the store, so a hung Redis opens the breaker quickly; the pipeline's
            # own late answer does not undo that (_slower_than_a_decision): a probe closes it
            self._refused = None
            self.breaker.failure(time.monotonic())
            self._breaker_changed()
            return exc
        if self.stalled():
            self._refused = None
            self.breaker.failure(time.monotonic())
            self._breaker_changed()
            return StoreUnavailable("the store is not answering (queued behind a stalled pipeline)")
        return Overloaded("the decision budget passed before its call could be sent")

    def _breaker_changed(self) -> None:
        state = self.breaker.state
        log = self.reachability
        if state == CLOSED and self._told == CLOSED and log.current and log.logged:
            # every pipeline's case: on_breaker was told closed already, the store is reachable and
            # logged so: nothing to report (the gauge's set of the same value cost a lock per pipeline)
            return
        self._told = state
        if self.on_breaker is not None:
            self.on_breaker(state)
        was = reachable = self.reachability.current
        if state == OPEN and reachable:
            reachable, self._opened_at = False, time.monotonic()
        elif state == CLOSED and not reachable:  # closed again (half-open is still unknown)
            reachable = True
        self.reachability.observe(reachable, self._reachability_line)
        if reachable != was and self.on_reachability is not None:
            self.on_reachability(reachable)

    def _reachability_line(self, reachable: Any, changes: int) -> tuple[int, str]:
        more = f"; {changes - 1} more changes since the last line" if changes > 1 else ""
        if reachable:
            return logging.INFO, (f"{self.name} reachable again: circuit breaker closed after "
                                  f"{time.monotonic() - self._opened_at:.1f} s{more}")
        if self._refused is not None:  # reachable, but refusing: an operator has to act
            return logging.ERROR, (f"{self.name} refuses the agent's commands "
                                   f"({sc.StoreRefused.CAUSES[self._refused.cause]}): circuit breaker open after "
                                   f"{self.breaker.failure_threshold} consecutive store failures; decisions "
                                   f"degrade per rule failMode{more}")
        return logging.WARNING, (f"{self.name} unreachable: circuit breaker open after "
                                 f"{self.breaker.failure_threshold} consecutive store failures; decisions "
                                 f"degrade per rule failMode{more}")

    async def release(self, key: str, slot_id: str, *, wait_s: float | None = None) -> bool:
        """End a concurrency slot; False when no live slot was freed (never taken, already
        released, expired). Like a decision it goes through the breaker and the batcher
        under the caller's budget: a hung Redis answers ``Unavailable`` (503, retriable; the lease
        also ends by its TTL) after ``wait_s``, not after the socket timeout."""
        (reply,) = await self.submit([("concurrency_release", [key], [slot_id])], wait_s=wait_s)
        if isinstance(reply, BaseException):
            raise translate(reply)
        return bool(int(reply[0]))

    async def renew(self, key: str, slot_id: str, ttl_ms: int, *, wait_s: float | None = None) -> bool:
        """Heartbeat of a live concurrency slot; False when it is gone (released or expired).
        Through the breaker and the batcher under the caller's budget, like a release."""
        (reply,) = await self.submit([("concurrency_renew", [key], [slot_id, ttl_ms])], wait_s=wait_s)
        if isinstance(reply, BaseException):
            raise translate(reply)
        return bool(int(reply[0]))

    async def close(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
        await self.batcher.close()
        try:
            await self.client.aclose()
        except Exception:  # closing a dead connection is not an error worth raising
            pass
