"""Chunks for a hot key set: the admissions of a tenant's hottest requests without a store
call each.

A *key set* is the rule keys of one request's multi-rule call (all in the tenant's slot). When one
agent process is asked for the same key set more than the rules' ``hotChunk.thresholdPerS`` times
a second (:class:`AttemptRate`), the request that finds no chunk takes one: ``lua/hot_chunk.lua``
charges up to ``chunk`` units (requests of cost 1) to every rule of the request at once, with the
multi-rule script's semantics, and takes what the rules hold when they hold less (a partial chunk
at the tail of a window or bucket). That request is admitted from it; the following requests of
the key set spend the rest in process, with no store call, until it is spent or its validity ends:
``hotChunk.validityMs`` at most, never past the end of a fixed window's or sliding counter's
current window or of the lease a pool slot was debited from (the script says how long), timed
from when the take was sent. Each take is a part of the key set's chunk (:class:`~.chunks.Chunk`:
spent earliest-expiring first, at most four kept). Unspent units are abandoned, never refunded (a
refund could not be made idempotent), and counted (``leasehold_agent_hot_chunk_abandoned_units_total``).

One take per key set at a time (single flight). A background take starts when the chunk falls to
a quarter of the last take, so a hot key set rarely finds it empty; the requests that do while a
take is in flight wait for it within their own budgets, then spend from it or ask the store
themselves. A take the store denies answers its request with the store's own denial (retry hint
and remaining from the script, so the negative cache holds it as any other), and no chunk is held.

The bound. A rule's key can be in several key sets (a tenant bucket with each user's bucket); the
units held in this process's chunks for one key never exceed its rule's ``chunkMax`` (a new
chunk is sized within what the key's rule still allows, :meth:`HotChunks._headroom`). So each
agent process admits at most ``chunkMax`` units of a rule beyond what the store counted, per
window of the rule (docs/bound.md, :func:`kernel.bound.hot_chunk_term`).

The pure parts (:class:`AttemptRate`, :func:`chunk_units`, :class:`KeySetChunk`) take the clock as
an argument; :class:`HotChunks` is the adapter the engine calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kernel.caches import BoundedMemo
from kernel.errors import LeaseholdError, ScriptRejected

from ..decision.call import ScriptCall, script_for
from ..decision.hot import HotConfig
from ..decision.plan import Plan
from .chunks import Chunk

log = logging.getLogger(__name__)

HOT_CHUNK = "hot_chunk"
RATE_SPAN_MS = 1_000  # the attempt rate is counted over the last second
#: A chunk holds what the key set is asked over this share of a validity at its current rate (at
#: least 2 units): renewed about twice per validity at steady demand, so a fall in demand leaves
#: little to abandon.
VALIDITY_SHARE = 0.5
MAX_TRACKED = 10_000  # key sets whose attempt rate is counted (a memo: cleared when full)
MAX_CHUNKS = 4_096  # key sets holding a chunk at once (more are not taken)


# ----------------------------------------------------------------------------------- pure parts
@dataclass(slots=True)
class AttemptRate:
    """Attempts per second of one key set at this process: a sliding count over
    :data:`RATE_SPAN_MS` in two buckets (the previous one weighted by the part of it the span still
    covers). One comparison and one addition per attempt unless a bucket ends."""

    start_ms: float = -1e18
    current: int = 0
    previous: int = 0

    def note(self, units: int, now_ms: float) -> None:
        if now_ms - self.start_ms >= RATE_SPAN_MS:
            self._roll(now_ms)
        self.current += units

    def _roll(self, now_ms: float) -> None:
        ended = int((now_ms - self.start_ms) // RATE_SPAN_MS)
        self.previous = self.current if ended == 1 else 0
        self.current = 0
        self.start_ms = now_ms if ended > 1 else self.start_ms + RATE_SPAN_MS

    def per_s(self, now_ms: float) -> float:
        """Attempts (units) over the last second."""
        if now_ms - self.start_ms >= RATE_SPAN_MS:
            self._roll(now_ms)
        left = max(0.0, 1.0 - (now_ms - self.start_ms) / RATE_SPAN_MS)
        return (self.current + self.previous * left) * 1000.0 / RATE_SPAN_MS


def chunk_units(rate_per_s: float, validity_ms: int, cost: int, chunk_max: int, headroom: int) -> int:
    """Units the next take asks for: what the key set is asked over :data:`VALIDITY_SHARE` of a
    validity at ``rate_per_s``, at least 2 and at least the asking request's ``cost``, at most
    ``chunk_max`` and what the keys' rules still allow this process to hold (``headroom``);
    0 when that does not cover ``cost`` (the request then asks the store alone)."""
    top = min(chunk_max, headroom)
    if top < cost:
        return 0
    need = math.ceil(rate_per_s * validity_ms / 1000.0 * VALIDITY_SHARE - 1e-9)
    return max(cost, min(top, max(2, need)))


@dataclass(slots=True)
class KeySetChunk:
    """One key set's chunk here: the parts its takes bought (:class:`~.chunks.Chunk`, spent
    earliest-expiring first, each abandoned when its validity ends), the store's remaining right
    after the last take, and the take in flight."""

    parts: Chunk = field(default_factory=Chunk)
    remaining: tuple[int, ...] = ()  # every slot's remaining in the store right after the last take
    taking: asyncio.Future | None = None  # the take in flight (single flight)
    last_take: int = 0  # units the last take asked for (the low-water mark is a quarter of it)
    scheduled: bool = False  # a background take is scheduled and has not started yet

    def spend(self, cost: int, now_ms: float) -> bool:
        return self.parts.try_take(cost, now_ms) is not None

    def usable(self, now_ms: float) -> int:
        return self.parts.usable(now_ms)


#: A background take starts when a chunk holds this share of its last take or less (the requests
#: keep spending the rest meanwhile, so a hot key set rarely finds its chunk empty).
LOW_WATER = 0.25


def hot_config(plan: Plan) -> HotConfig | None:
    """The chunking of ``plan``'s key set, or None when it cannot be chunked: its shape's rules do
    not allow it (region_agent.decision.hot), or this request carries shadow calls or a decision
    record."""
    shape = plan.shape
    if shape is None or not plan.calls or plan.shadow_calls or plan.decision_ttl_ms:
        return None
    return shape.hot


def hot_chunk_call(keys: list[str], cfg: HotConfig, *, member: str, min_units: int, want: int,
                   slack_ms: int) -> ScriptCall:
    # the lean variant of the script for the kinds of the slots (a slot: its kind and five parameters)
    return (script_for(cfg.unit_argv[::6], HOT_CHUNK), keys, [slack_ms, member, min_units, want, *cfg.unit_argv])


class Taken(NamedTuple):
    taken: int
    valid_for_ms: int  # -1: no rule bounds it
    reply: list[int]  # the multi-rule reply it means (allowed, denied_by, retry, remaining ..)


def parse_hot_chunk(reply: Any, n: int) -> Taken:
    if isinstance(reply, BaseException):
        raise reply if isinstance(reply, LeaseholdError) else ScriptRejected("hot_chunk failed")
    if not isinstance(reply, list | tuple) or len(reply) != 5 + n:
        raise ScriptRejected("unexpected reply shape from hot_chunk")
    vals = [int(x) for x in reply]
    return Taken(vals[0], vals[1], vals[2:])


class ChunkReply(list):
    """A multi-rule reply made in process: the key set's chunk paid the request (no store call)."""

    __slots__ = ()


# ----------------------------------------------------------------------------------- the adapter
class HotChunks:
    """The hot key sets' chunks of one agent process (one per engine)."""

    def __init__(self, *, store: Any, metrics: Any, now_ms: Callable[[], float]):
        self.store = store
        self.metrics = metrics
        self.now_ms = now_ms
        self.rates: BoundedMemo[tuple, AttemptRate] = BoundedMemo(MAX_TRACKED)
        self.chunks: dict[tuple, KeySetChunk] = {}
        self.by_key: dict[str, set[tuple]] = {}  # rule key -> key sets whose chunk may hold units of it
        self.reserved: dict[str, int] = {}  # rule key -> units asked by takes in flight (other key sets too)
        self._ids = itertools.count(1)
        self._background: set[asyncio.Task] = set()

    async def settled(self) -> None:
        """Wait for the background takes in flight (tests; a clean stop)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def pay(self, plan: Plan) -> ChunkReply | None:
        """The reply made from the key set's chunk when it pays ``plan``'s request now (counted as
        an attempt either way); None: the request needs the store (a batch item: in the batch)."""
        cfg = hot_config(plan)
        if cfg is None:
            return None
        ks, cost, now = self._note(plan, cfg)
        chunk = self.chunks.get(ks)
        if chunk is not None and chunk.spend(cost, now):
            return self._paid(ks, chunk, cfg, plan, now)
        return None

    def _note(self, plan: Plan, cfg: HotConfig) -> tuple[tuple, int, float]:
        ks = (tuple(c.key for c in plan.calls), cfg.unit_argv)
        now = self.now_ms()
        rate = self.rates.get(ks)
        if rate is None:
            rate = self.rates.put(ks, AttemptRate())
        rate.note(plan.cost_hint, now)
        return ks, plan.cost_hint, now

    def _rate(self, ks: tuple, now: float) -> float:
        rate = self.rates.get(ks)
        return rate.per_s(now) if rate is not None else 0.0

    async def ask(self, plan: Plan, calls: list[ScriptCall], deadline_s: float,
                  clock_s: Callable[[], float]) -> list[Any]:
        """The replies to ``plan``'s ``calls``: one made from the key set's chunk, a take's (this
        request's answer from it), or the store's to the calls themselves. Raises a
        ``LeaseholdError`` as ``Store.submit`` does."""
        cfg = hot_config(plan)
        if cfg is None:
            return await self.store.submit(calls, wait_s=max(0.0, deadline_s - clock_s()))
        ks, cost, now = self._note(plan, cfg)
        chunk = self.chunks.get(ks)
        if chunk is not None:
            if chunk.spend(cost, now):
                return [self._paid(ks, chunk, cfg, plan, now)]
            if chunk.taking is not None:  # single flight: wait for the take in flight, then spend from it
                try:
                    await asyncio.wait_for(asyncio.shield(chunk.taking), max(0.0, deadline_s - clock_s()))
                except (TimeoutError, LeaseholdError):
                    pass
                now = self.now_ms()
                chunk = self.chunks.get(ks)
                if chunk is not None and chunk.spend(cost, now):
                    return [self._paid(ks, chunk, cfg, plan, now)]
        per_s = self._rate(ks, now)
        if per_s < cfg.threshold_per_s or (chunk is None and len(self.chunks) >= MAX_CHUNKS) \
                or (chunk is not None and chunk.taking is not None):
            return await self.store.submit(calls, wait_s=max(0.0, deadline_s - clock_s()))
        got = await self._take(ks, cfg, cost, per_s, plan.slack_ms, max(0.0, deadline_s - clock_s()))
        if got is None:  # the keys' rules allow this process no more chunk units: the request asks alone
            return await self.store.submit(calls, wait_s=max(0.0, deadline_s - clock_s()))
        return got

    # ------------------------------------------------------------------ spending
    def _paid(self, ks: tuple, chunk: KeySetChunk, cfg: HotConfig, plan: Plan, now: float) -> ChunkReply:
        left = chunk.usable(now)
        if chunk.taking is None and not chunk.scheduled and left <= chunk.last_take * LOW_WATER:
            per_s = self._rate(ks, now)
            if per_s >= cfg.threshold_per_s:  # still hot: the next chunk before this one is spent
                chunk.scheduled = True
                task = asyncio.ensure_future(self._take(ks, cfg, 1, per_s, plan.slack_ms, None))
                self._background.add(task)
                task.add_done_callback(self._background_done)
        # remaining: the store's right after the last take, plus what this chunk still holds
        return ChunkReply([1, 0, 0, *(r + left * u for r, u in zip(chunk.remaining, cfg.unit_cost, strict=True))])

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the store failed: requests will ask it
            log.debug("background chunk take failed: %r", task.exception())

    def _sweep(self, ks: tuple, chunk: KeySetChunk, now: float) -> int:
        """Drop what expired (counted as abandoned); forget a chunk that holds nothing and takes
        nothing. Returns the units it still holds."""
        left = chunk.usable(now)
        wasted = chunk.parts.take_abandoned()
        if wasted:
            self.metrics.hot_chunk_abandoned.inc(wasted)
        if left == 0 and chunk.taking is None:
            self.chunks.pop(ks, None)
            for key in ks[0]:
                sets = self.by_key.get(key)
                if sets is not None:
                    sets.discard(ks)
                    if not sets:
                        del self.by_key[key]
        return left

    def _headroom(self, ks: tuple, cfg: HotConfig, now_ms: float) -> int:
        """Units a new part of ``ks``'s chunk may hold: for every key, its rule's chunkMax less
        what this process's chunks hold of it now (this key set's own included) and what takes in
        flight for other key sets with that key may add."""
        room = None
        for key, top in zip(ks[0], cfg.chunk_max, strict=True):
            held = self.reserved.get(key, 0)
            for other in list(self.by_key.get(key, ())):
                c = self.chunks.get(other)
                held += 0 if c is None else self._sweep(other, c, now_ms)
            room = top - held if room is None else min(room, top - held)
        return max(0, room or 0)

    # ------------------------------------------------------------------ taking
    async def _take(self, ks: tuple, cfg: HotConfig, cost: int, rate: float, slack_ms: int,
                    wait_s: float | None) -> list[Any] | None:
        """One take of ``ks``'s chunk: ``cost`` units at least, for the asking request (``cost``
        1 and ``wait_s`` None: a background take nobody waits for). Returns the asking request's
        replies, or None when the keys' rules allow this process no more units."""
        now = self.now_ms()
        current = self.chunks.get(ks)
        if current is not None and wait_s is None:
            current.scheduled = False  # this is the scheduled background take, starting
        if current is not None and current.taking is not None:
            return None
        # (the headroom sweeps what expired, this key set's own chunk included: look it up after)
        want = chunk_units(rate, cfg.validity_ms, cost, min(cfg.chunk_max), self._headroom(ks, cfg, now))
        if want == 0:
            return None
        chunk = self.chunks.get(ks)
        if chunk is None:
            chunk = self.chunks[ks] = KeySetChunk()
        background = wait_s is None
        asker = 0 if background else cost  # units the asking request spends at once
        keys = list(ks[0])
        fut = chunk.taking = asyncio.get_running_loop().create_future()
        chunk.last_take = want
        for key in keys:
            self.reserved[key] = self.reserved.get(key, 0) + want
        outcome = "error"
        try:
            sent_at = self.now_ms()  # validity is timed from when the take was sent
            (raw,) = await self.store.submit([hot_chunk_call(keys, cfg, member=f"hc{next(self._ids)}-{id(self):x}",
                                                             min_units=cost, want=want, slack_ms=slack_ms)],
                                             wait_s=wait_s)
            got = parse_hot_chunk(raw, len(keys))
            if got.taken == 0:
                outcome = "denied"
                return [got.reply]
            outcome = "taken" if got.taken >= want else "partial"
            validity = cfg.validity_ms if got.valid_for_ms < 0 else min(cfg.validity_ms, got.valid_for_ms)
            spare = got.taken - asker
            if spare > 0:
                chunk.parts.grant(spare, sent_at, validity)
                for key in keys:
                    self.by_key.setdefault(key, set()).add(ks)
            chunk.remaining = tuple(got.reply[3:])
            held = chunk.usable(self.now_ms())
            reply = list(got.reply)
            reply[3:] = [r + held * u for r, u in zip(chunk.remaining, cfg.unit_cost, strict=True)]
            return [reply]
        finally:
            self.metrics.hot_chunks.labels(outcome).inc()
            for key in keys:
                left = self.reserved.get(key, 0) - want
                if left > 0:
                    self.reserved[key] = left
                else:
                    self.reserved.pop(key, None)
            chunk.taking = None
            fut.set_result(None)
            self._sweep(ks, chunk, self.now_ms())
