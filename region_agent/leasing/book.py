"""The region's lease book for one pool — pure, clock passed in (monotonic milliseconds).

Timing rule (docs/invariants.md I19): a lease is spendable from ``received + startsInMs``
until ``sent + ttlMs``, both on this process's monotonic clock. The allocator's expiry is
``issuedAt + ttlMs`` with ``issuedAt >= sent`` in real time, so network delay and clock skew
only ever shorten the region's view of a lease; a prefetched lease starts no earlier than
the window it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kernel.bundle import Pool
from kernel.errors import StaleEpoch
from kernel.wire import LeaseGrant


class BalanceState(StrEnum):
    """A leased pool balance as this agent's lease manager sees it (``LeaseManager.state``)."""

    OK = "ok"
    EXHAUSTED = "exhausted"  # the allocator said the pool is spent for this window
    UNREACHABLE = "unreachable"  # the allocator cannot be reached and no held lease is valid
    IDLE = "idle"  # no balance is followed for this key


@dataclass(frozen=True, slots=True)
class HeldLease:
    lease_id: str
    pool: str
    window_index: int
    granted: int
    epoch: int
    valid_from: float  # monotonic ms
    deadline: float  # monotonic ms; never spend at or after this
    window_end: float  # monotonic ms estimate of the window's end (for exhaustion hints)


def grant_window_end(grant: LeaseGrant, sent_at: float) -> float:
    """The end of the window a grant names, on this process's monotonic clock (ms): issued -> end
    is (end - issuedAt) of allocator time, counted from when the request was sent."""
    return sent_at + (grant.window.end_ms - grant.issued_at_ms)


@dataclass
class PoolBook:
    pool: Pool
    leases: dict[str, HeldLease] = field(default_factory=dict)
    max_epoch: int = 0
    exhausted_window: int | None = None  # allocator answered "nothing left" for this window index
    exhausted_until: float = 0.0  # monotonic ms: the next window's start, as estimated
    unreachable_since: float | None = None  # monotonic ms of the first failed attempt in a row
    demand_rate: float = 0.0  # tokens/s, EWMA of what the region asked to spend
    refused_until: float = 0.0  # monotonic ms: Redis refused a deposit (balance full); no top-up before
    _demand_acc: int = 0
    _demand_t0: float | None = None

    # ----------------------------------------------------------------- grants
    def accept(self, grant: LeaseGrant, *, sent_at: float, received_at: float,
               requested_id: str | None = None) -> HeldLease | None:
        """Record a grant. Returns the held lease, or None for a zero grant (pool exhausted).

        Raises :class:`StaleEpoch` for a grant older than an epoch already seen (I4)."""
        own_replay = grant.replayed and requested_id is not None and grant.lease_id == requested_id
        if grant.epoch < self.max_epoch and not own_replay:
            raise StaleEpoch(f"grant {grant.lease_id} has epoch {grant.epoch} < {self.max_epoch} already seen")
        # a replay of the request we are waiting for is the record etcd committed under the epoch
        # in force at the time (fencing made sure of that): accept it, but it never lowers max_epoch
        self.max_epoch = max(self.max_epoch, grant.epoch)
        self.unreachable_since = None
        window_end = grant_window_end(grant, sent_at)
        if grant.granted <= 0:
            if grant.starts_in_ms == 0:
                self.exhausted_window = grant.window.index
                self.exhausted_until = window_end
            return None
        lease = HeldLease(lease_id=grant.lease_id, pool=grant.pool, window_index=grant.window.index,
                          granted=grant.granted, epoch=grant.epoch,
                          valid_from=received_at + max(0, grant.starts_in_ms),
                          deadline=sent_at + grant.ttl_ms, window_end=window_end)
        if lease.deadline <= lease.valid_from:
            return None  # arrived too late to be spendable: adds nothing
        self.leases[lease.lease_id] = lease
        return lease

    def note_unreachable(self, now: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = now

    def reopen(self) -> None:
        """Tokens went back to the window this book was told is exhausted: ask again."""
        self.exhausted_window = None
        self.exhausted_until = 0.0

    def exhausted(self, now: float) -> bool:
        return self.exhausted_window is not None and now < self.exhausted_until

    def exhausted_retry_ms(self, now: float) -> int:
        return max(0, int(self.exhausted_until - now + 0.999))

    # ----------------------------------------------------------------- state
    def valid(self, now: float) -> list[HeldLease]:
        return [lease for lease in self.leases.values() if lease.valid_from <= now < lease.deadline]

    def future(self, now: float) -> list[HeldLease]:
        return [lease for lease in self.leases.values() if now < lease.valid_from]

    def expired(self, now: float) -> list[HeldLease]:
        return [lease for lease in self.leases.values() if now >= lease.deadline]

    def forget(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)

    # ----------------------------------------------------------------- demand and top-ups
    def note_demand(self, tokens: int, now: float, half_life_ms: float = 2_000.0) -> None:
        """Count tokens the region tried to spend; folded into an EWMA rate every 250 ms."""
        if self._demand_t0 is None:
            self._demand_t0 = now
        self._demand_acc += tokens
        elapsed = now - self._demand_t0
        if elapsed >= 250.0:
            inst = self._demand_acc * 1000.0 / elapsed
            alpha = 1.0 - 0.5 ** (elapsed / half_life_ms)
            self.demand_rate += alpha * (inst - self.demand_rate)
            self._demand_acc = 0
            self._demand_t0 = now

    def rate_now(self, now: float) -> float:
        """The demand rate to plan with: the EWMA, or the rate of the interval being counted when
        that is higher (at the start of a burst the EWMA lags by its half-life; asking for
        ``chunkMin`` leases then fills the regional balance's entry limit with tiny leases)."""
        if self._demand_t0 is None:
            return self.demand_rate
        partial = self._demand_acc * 1000.0 / max(50.0, now - self._demand_t0)
        return max(self.demand_rate, partial)

    def want(self, horizon_ms: float, now: float | None = None) -> int:
        """How much to ask for: the demand over ``horizon_ms``, within the pool's chunk bounds."""
        rate = self.demand_rate if now is None else self.rate_now(now)
        need = int(rate * horizon_ms / 1000.0 + 0.999)
        return max(self.pool.chunk_min, min(self.pool.chunk_max, need))

    def note_refused(self, now: float, backoff_ms: float = 1_000.0) -> None:
        """Redis refused a deposit (the balance holds its maximum of entries) or could not be asked:
        no top-up for ``backoff_ms`` — asking again at once would only buy leases that cannot be
        deposited."""
        self.refused_until = now + backoff_ms

    def low_water(self, rtt_ms: float, margin_ms: float = 250.0) -> int:
        """Ask for more when the spendable balance would not last one allocator round trip
        plus a margin at the observed spend rate."""
        return max(1, int(self.demand_rate * (rtt_ms + margin_ms) / 1000.0 + 0.999))

    def needs_topup(self, balance: int, now: float, rtt_ms: float) -> bool:
        """Below the low-water mark - unless the next window's lease is held and starts within two
        round trips. A top-up then is for the window in progress, which ends where that lease starts
        (its start here is late by up to the round trip it came in): landing within a round trip of
        that end, its grant would have little or nothing to spend before the window ends, and,
        arriving at the allocator after the window ended on its clock, it would be a second lease of
        the next window."""
        if self.exhausted(now) or now < self.refused_until or balance >= self.low_water(rtt_ms):
            return False
        soon = now + 2 * rtt_ms
        return not any(now < lease.valid_from < soon for lease in self.leases.values())

    def prefetch_due(self, now: float, rtt_ms: float) -> bool:
        """Time to ask for the next window's lease ahead of the window's end: the window this book
        spends from (a valid lease's, or the one the allocator said is exhausted) ends within the
        pool's prefetch time and no lease of a later window is held. Without it a balance whose last
        lease lasts to the window's end (the allocator sizes a lease by the time it can be spent),
        or whose window is exhausted, starts no top-up before the window ends, and every request at
        the rollover waits for one.

        The allocator opens window ``k + 1`` ``prefetchMs`` before its start on *its* clock, and a
        grant's window end on this clock is early by up to the round trip it came in
        (:func:`grant_window_end`): the window must end within ``prefetchMs - rtt_ms`` here, so the
        allocator is not asked too early."""
        if self.pool.prefetch_ms <= 0 or now < self.refused_until or self.future(now):
            return False
        ends = [lease.window_end for lease in self.valid(now)]
        if self.exhausted(now):
            ends.append(self.exhausted_until)
        if not ends:
            return False
        left = min(ends) - now
        return 0 < left and left + rtt_ms <= self.pool.prefetch_ms
