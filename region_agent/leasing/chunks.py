"""In-process chunks for fleet-wide (global-scope) pools.

Pure state: the clock (monotonic ms) is passed in. A chunk is bought from the pool's
``{g:<pool>}`` balance with one store call (``pool_take.lua``: valid no longer than the leases
it came from, so never past their window), spent locally, and what a part still holds shortly
before its validity ends is taken out of it for a *refund* to the leases its ``pool_take`` debited
(:meth:`Chunk.due_refunds`; the store call is ``fleet_pools``'s: ``pool_refund.lua``), so that
their close reports those tokens unspent
(docs/decisions/0042-a-chunk-parts-rest-is-refunded-before-it-ends.md); what a part holds when it
ends before its refund ran (a stalled event loop), or that a renewal pushes out beyond
:data:`MAX_PARTS`, is refunded at once (the store accepts a refund until the lease's record is
closed); tokens given back after the refund, and parts that debited no lease, are abandoned. A reservation taken for a request whose tenant script then denies is given
back to the same chunk, in-process only: to the part it came from, which a renewal keeps while it is
valid even if the reservation emptied it (a part dropped as empty while its last tokens were out on
reservations lost them when they came back: bought, reported spent by their lease, never admitted;
docs/decisions/0041-a-part-emptied-by-reservations-is-kept.md). A give-back with no part left to
land in (the part expired meanwhile) is counted abandoned.

The negative cache of a chunk is by cost: a renewal that could not pay ``cost`` denies locally
requests of at least that cost until ``deny_until_ms``; cheaper requests are not blocked by it
(one expensive request must not deny the cheap ones the pool can still serve). A pool's hint is
not exact: tokens may come back before it ends (a lease that ended unspent returns its rest to the
window, and the region leases it again), so the local denial is held at most ``hold_ms`` (the
agent's ``negative_cache_ms``, as for the decision path's negative cache) and the next request then
asks the balance again with one renewal, while the answer keeps the pool's own hint. (Held for the
whole hint, up to a validity, an exhausted pool's 10 returned tokens sat in the balance for a
second while both agents denied every request; the window ended with 4 of them unspent:
docs/decisions/0037-a-chunks-denial-is-held-like-the-negative-cache.md). A lease this agent
deposits spendable at once lifts its own chunk's denial of that pool (:meth:`Chunk.lift`): the
tokens are in the balance now, the hold would only deny them.

Sizing. What a chunk holds when its validity ends is lost to everyone: it was debited from the
regional balance (so its lease reports it spent). A refund shortly before the end recovers it, but
costs a store call and may land too late (after the lease's close), and tokens returned to a lease
that ends with its window are not spent in it either. A chunk is therefore still sized
by what its holder is asked, not by the pool's ``chunkMax``: the tokens requests asked of this
pool at this agent over the last :data:`SPEND_SHARE` of ``chunkValidityMs``, or that share of what
they asked over the whole validity if more (:class:`RecentDemand`, net of tokens given back), at
least what the requests waiting for the renewal need, within [cost, ``chunkMax``]. At steady demand
a chunk is spent in a quarter of its validity, so demand may fall to a quarter meanwhile before
any token expires unspent; the short horizon lets a burst after a quiet spell grow the chunk within
a renewal or two (each renewal is one store call). The renewal
also tells ``pool_take.lua`` the rate (:func:`tokens_per_s`) so that a chunk taken from a lease
ending sooner than the validity holds no more than that lease's remaining life can spend — but
never fewer than the requests waiting for it need (spent at once).
(A fixed chunk of ``chunkMax`` valid 1 s at an agent asked 6 tokens/s expired half full, and the
pool ran dry at two thirds of G while requests were denied.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NO_CHUNK = -1  # generation of tokens bought for one request only (never given back to the chunk)

#: A chunk holds this share of what its holder was asked over one validity (see the module text).
SPEND_SHARE = 0.25


@dataclass(slots=True)
class RecentDemand:
    """Tokens asked recently, in buckets of a quarter of ``span_ms`` (a chunk's validity): over the
    last quarter and over the whole span, each a sliding count (the oldest bucket weighted by how
    much of it the window still covers). Counting costs one comparison and one addition unless a
    bucket ends."""

    start_ms: float = 0.0  # start of the current bucket
    quarter_ms: float = 0.0  # bucket length: SPEND_SHARE x span
    current: int = 0
    past: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # the buckets before, newest first

    def _roll(self, now_ms: float, span_ms: float) -> None:
        quarter = span_ms * SPEND_SHARE
        if quarter != self.quarter_ms:  # a new span (a policy change): start over
            self.quarter_ms, self.start_ms, self.current, self.past = quarter, now_ms, 0, [0, 0, 0, 0]
            return
        ended = int((now_ms - self.start_ms) // quarter)
        if ended >= 1:
            self.past = ([0] * (ended - 1) + [self.current] + self.past)[:4]
            self.current = 0
            self.start_ms += ended * quarter

    def note(self, tokens: int, now_ms: float, span_ms: float) -> None:
        """``tokens`` asked (negative: given back, never below nothing asked)."""
        if now_ms - self.start_ms >= self.quarter_ms or self.quarter_ms != span_ms * SPEND_SHARE:
            self._roll(now_ms, span_ms)
        self.current += tokens
        if self.current < 0:
            self.current = 0

    def over(self, now_ms: float, span_ms: float) -> tuple[float, float]:
        """(tokens asked over the last quarter of the span, over the whole span)."""
        self._roll(now_ms, span_ms)
        left = max(0.0, 1.0 - (now_ms - self.start_ms) / self.quarter_ms)  # of the oldest bucket still covered
        p = self.past
        return self.current + p[0] * left, self.current + p[0] + p[1] + p[2] + p[3] * left


def chunk_size(asked: float, recent: float, waiting: int, cost: int, chunk_max: int) -> int:
    """Tokens a renewal asks for: ``recent`` (tokens asked over the last :data:`SPEND_SHARE` of a
    validity) or :data:`SPEND_SHARE` of ``asked`` (over the whole validity), whichever is more, at
    least ``waiting`` (the requests waiting for this renewal), within [``cost``, max(``cost``,
    ``chunk_max``)]."""
    need = max(float(waiting), recent, asked * SPEND_SHARE)
    return max(cost, min(chunk_max, math.ceil(need - 1e-9)))


def tokens_per_s(want: int, validity_ms: int) -> int:
    """The most a chunk of ``want`` tokens for ``validity_ms`` may hold per second of the validity
    it really gets (``pool_take.lua`` caps a chunk from a lease that ends sooner), rounded up."""
    return max(1, math.ceil(want * 1000 / max(1, validity_ms)))


@dataclass(slots=True)
class Part:
    """The tokens one renewal bought (one generation), valid until ``expires_at_ms``."""

    generation: int
    tokens: int
    expires_at_ms: float
    fallback: bool = False  # bought from the pool's fallback allowance (allocator unreachable)
    # (lease id, tokens) pool_take debited from each lease: the most a refund gives back to it
    debits: tuple[tuple[str, int], ...] = ()
    bought_at_ms: float = 0.0  # when the renewal that bought it was sent
    refunded: bool = False  # its unspent rest was taken out for a refund (once per part)

    def refund_at_ms(self, lead_ms: float) -> float:
        """When its unspent rest is taken out for a refund: ``lead_ms`` before its end, but not in
        the first half of its validity (a short part is spent first, not refunded at once)."""
        return self.expires_at_ms - min(lead_ms, (self.expires_at_ms - self.bought_at_ms) / 2)

    def refundable(self) -> bool:
        return self.tokens > 0 and bool(self.debits) and not self.refunded and not self.fallback


#: A part is due for its refund this long before its refund time at the latest (timer granularity).
REFUND_EARLY_MS = 1.0
#: The newest part is not refunded while requests still wait for the renewal that bought it (see
#: Chunk.held); its refund is looked at again this much later.
HELD_RECHECK_MS = 1.0


#: Parts holding tokens a chunk keeps at once (the newest renewal's and the leftovers of earlier ones
#: still valid); beyond that the earliest-expiring is refunded at once (abandoned if it debited no lease).
MAX_PARTS = 4
#: Empty parts (their tokens spent, or out on reservations whose requests are still being decided) a
#: chunk keeps until they expire, the newest first: a reservation given back lands in its own part.
MAX_EMPTY_PARTS = 4


@dataclass(slots=True)
class Chunk:
    """A fleet-wide pool's chunk at one agent: the parts its renewals bought, spent
    earliest-expiring first. A renewal never abandons what the chunk still holds, nor what is out
    on reservations: a reservation given back (its request was not admitted) before or after a
    renewal lands in the part it came from, which stays spendable until its own validity ends —
    never in another part, whose validity (and window) may differ."""

    parts: list[Part] = field(default_factory=list)
    deny_until_ms: float = 0.0  # the local denial is held until then (at most the hold)
    retry_at_ms: float = 0.0  # and answers with the pool's own hint: come back then
    deny_min_cost: int = 1  # the local denial applies to requests of at least this cost
    generation: int = 0  # bumps on every grant: a part's identity for give-backs
    fallback: bool = False  # the last renewal was from (or denied by) the pool's fallback allowance
    demand: RecentDemand = field(default_factory=RecentDemand)  # tokens asked over one validity
    waiting: int = 0  # tokens of the requests waiting for a renewal now
    abandoned: int = 0  # tokens of parts dropped unspent (expired, or beyond MAX_PARTS) not yet counted
    # parts dropped with their rest before their refund ran (ended, or beyond MAX_PARTS): refunded next
    late: list[tuple[Part, int]] = field(default_factory=list)

    def ask(self, cost: int, now_ms: float, validity_ms: int) -> None:
        """A request asks ``cost`` tokens of the pool (counted once per request); negative: a
        reservation given back (its request was not admitted)."""
        self.demand.note(cost, now_ms, validity_ms)

    def want(self, cost: int, chunk_max: int, now_ms: float, validity_ms: int) -> int:
        """The size of the next chunk (:func:`chunk_size`)."""
        recent, asked = self.demand.over(now_ms, validity_ms)
        return chunk_size(asked, recent, self.waiting, cost, chunk_max)

    def _valid(self, now_ms: float) -> list[Part]:
        parts = self.parts  # in expiry order
        while parts and parts[0].expires_at_ms <= now_ms:
            self._drop(parts.pop(0))  # expired unspent
        return parts

    def _drop(self, p: Part) -> None:
        """A part leaves the chunk with its rest: refunded next if it can be, else abandoned."""
        if p.refundable():
            self.late.append((p, p.tokens))
            p.tokens = 0
            p.refunded = True
        else:
            self.abandoned += p.tokens

    def take_abandoned(self) -> int:
        """Tokens abandoned since the last call (for the ``chunk_abandoned`` metric)."""
        n, self.abandoned = self.abandoned, 0
        return n

    def usable(self, now_ms: float) -> int:
        """Tokens requests can take right now."""
        return sum(p.tokens for p in self._valid(now_ms))

    def try_take(self, cost: int, now_ms: float) -> Part | None:
        """Spend ``cost`` tokens locally from the earliest-expiring part that holds them; returns
        that part (its generation for a give-back), or None."""
        for p in self._valid(now_ms):
            if p.tokens >= cost:
                p.tokens -= cost
                return p
        return None

    def give_back(self, cost: int, generation: int, now_ms: float, validity_ms: int) -> bool:
        """A reservation whose request was not admitted: not demand the chunk paid for; its tokens
        return to the part they came from while it is valid (never to another part)."""
        self.ask(-cost, now_ms, validity_ms)
        for p in self._valid(now_ms):
            if p.generation == generation:
                p.tokens += cost
                return True
        self.abandoned += cost  # its part has expired (or it was bought alone): bought, never admitted
        return False

    def held(self, p: Part) -> bool:
        """``p`` is the newest part and requests still wait for the renewal that bought it: its
        tokens are theirs (it was sized for them), however short its life. They resume a few event
        loop turns after it landed; a refund timer already due (a part bought in a lease's last
        moments lands past the middle of its life) must not take their tokens out first."""
        return self.waiting > 0 and p.generation == self.generation

    def refund_at_ms(self, now_ms: float, lead_ms: float) -> float | None:
        """When the next part holding tokens is due for its refund (None: no part is)."""
        times = [max(p.refund_at_ms(lead_ms), now_ms + HELD_RECHECK_MS) if self.held(p) else p.refund_at_ms(lead_ms)
                 for p in self._valid(now_ms) if p.refundable()]
        if self.late:
            times.append(now_ms)
        return min(times) if times else None

    def due_refunds(self, now_ms: float, lead_ms: float) -> list[tuple[Part, int]]:
        """The parts due for their refund (``lead_ms`` before their end at the latest) with the
        tokens taken out of each: from now on they can never be spent locally (a reservation out
        on them that comes back lands in the part, spendable until it ends, and is not refunded),
        and the parts dropped with their rest before their refund ran."""
        valid = self._valid(now_ms)
        due, self.late = self.late, []
        for p in valid:
            if p.refundable() and not self.held(p) and now_ms >= p.refund_at_ms(lead_ms) - REFUND_EARLY_MS:
                due.append((p, p.tokens))
                p.tokens = 0
                p.refunded = True
        return due

    def negative(self, now_ms: float, cost: int = 1) -> bool:
        return now_ms < self.deny_until_ms and cost >= self.deny_min_cost

    def grant(self, tokens: int, now_ms: float, validity_ms: int, *, fallback: bool = False,
              debits: tuple[tuple[str, int], ...] = ()) -> None:
        """A renewal succeeded: a new part (``debits``: what it took from each lease, for its
        refund). Earlier parts keep what they hold until they expire (beyond :data:`MAX_PARTS`
        holding tokens the earliest-expiring is dropped: refunded at once, or abandoned). Empty ones are kept too until they
        expire (the newest :data:`MAX_EMPTY_PARTS`): their tokens may be out on reservations whose
        requests are still being decided, and come back."""
        self.generation += 1
        self.fallback = fallback
        valid = self._valid(now_ms)
        held = [p for p in valid if p.tokens > 0]
        held.append(Part(self.generation, tokens, now_ms + validity_ms, fallback, () if fallback else debits, now_ms))
        held.sort(key=lambda p: p.expires_at_ms)
        empty = sorted((p for p in valid if p.tokens <= 0), key=lambda p: p.generation)[-MAX_EMPTY_PARTS:]
        for p in held[:-MAX_PARTS]:
            self._drop(p)
        self.parts = sorted(held[-MAX_PARTS:] + empty, key=lambda p: p.expires_at_ms)
        self.deny_until_ms = self.retry_at_ms = 0.0
        self.deny_min_cost = 1

    def lift(self) -> None:
        """The region's balance was refilled (this agent deposited a lease spendable now): the local
        denial ends at once, so the next request asks the balance again instead of waiting out the
        hold (tokens an ended lease returned and the region leased again are spent, not denied)."""
        self.deny_until_ms = 0.0

    def retry_ms(self, now_ms: float) -> int:
        """The hint a locally denied request gets: the pool's, as the renewal was told it."""
        return max(1, int(self.retry_at_ms - now_ms))

    def deny(self, now_ms: float, retry_after_ms: int, validity_ms: int, min_cost: int = 1,
             hold_ms: int | None = None) -> int:
        """A renewal could not pay ``min_cost``: deny requests of at least that cost locally for
        min(hint, validity, ``hold_ms``); returns the hint, min(hint, validity). The chunk's own
        leftovers stay spendable."""
        wait = validity_ms if retry_after_ms < 0 else min(max(retry_after_ms, 1), validity_ms)
        self.deny_until_ms = now_ms + (wait if hold_ms is None else min(wait, max(0, hold_ms)))
        self.retry_at_ms = now_ms + wait
        self.deny_min_cost = min_cost
        return wait
