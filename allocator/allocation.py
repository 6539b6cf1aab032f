"""Pure allocation: how much of a pool window a region is granted, and what a usage report gives
back (grant, depletion and fairness; docs/invariants.md I16). "Allocation", not "policy": the
policy is the bundle (``docs/glossary.md``); this module applies its pools.

No I/O and no clock of its own: every function takes ``now_ms`` (the leader's wall clock in
milliseconds). The transaction loop (``allocator.transactions``) takes a window's state from the
window cache, calls :func:`decide_grant` / :func:`decide_reclaim` on it and writes the result
back in one epoch-fenced transaction.

Units: tokens are whole tokens; times and durations are integer milliseconds; ``demand`` is
tokens per second.

Invariant kept by every function here, per pool window::

    sum(granted) - sum(returned) == limit - remaining  and  0 <= remaining <= limit
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from kernel.bundle import Pool
from kernel.errors import Conflict, Forbidden, ValidationFailed
from kernel.wire import LeaseGrant, WindowRef

WindowChoice = Literal["current", "next"]


class RegionActivity(Struct, rename="camel"):
    """The last time a region asked this window for tokens, and the demand it reported."""

    last_ms: int
    demand: int = 0


class WindowState(Struct, rename="camel"):
    """One pool window's state, stored as JSON at ``pools/<pool>/<k>``."""

    pool: str
    index: int
    limit: int
    remaining: int
    granted: dict[str, int] = {}
    leases: dict[str, int] = {}
    reported: dict[str, int] = {}  # leases whose usage report was accepted
    reported_tokens: dict[str, int] = {}  # tokens granted in those leases
    returned: dict[str, int] = {}  # tokens given back by usage reports
    spent: dict[str, int] = {}  # tokens those reports say were spent (the evidence behind demand claims)
    active: dict[str, RegionActivity] = {}
    exhausted: bool = False

    @property
    def total_granted(self) -> int:
        return sum(self.granted.values())

    @property
    def total_returned(self) -> int:
        return sum(self.returned.values())

    @property
    def leases_outstanding(self) -> int:
        return sum(self.leases.values()) - sum(self.reported.values())

    def copy(self) -> WindowState:
        return msgspec.convert(msgspec.to_builtins(self), WindowState)


class GrantDecision(Struct):
    granted: int
    window: WindowRef
    expires_at_ms: int
    ttl_ms: int
    starts_in_ms: int
    remaining: int
    exhausted_now: bool  # this grant took the window's remaining to 0


class ReclaimDecision(Struct):
    returned: int  # tokens given back to the window's remaining
    stranded: int  # unspent tokens that could not be returned (window closed)
    window_open: bool


# --------------------------------------------------------------------------------------------
def window_index(now_ms: int, window_ms: int) -> int:
    return now_ms // window_ms


def window_ref(index: int, window_ms: int) -> WindowRef:
    return WindowRef(index=index, start_ms=index * window_ms, end_ms=(index + 1) * window_ms)


def new_window(pool: Pool, index: int) -> WindowState:
    return WindowState(pool=pool.id, index=index, limit=pool.limit, remaining=pool.limit)


def target_window(pool: Pool, which: WindowChoice, now_ms: int) -> int:
    """The window index a request is for. ``next`` only within ``prefetchMs`` of the boundary."""
    k = window_index(now_ms, pool.window_ms)
    if which == "current":
        return k
    boundary = (k + 1) * pool.window_ms
    if boundary - now_ms > pool.prefetch_ms:
        raise Conflict(
            f"prefetch of pool {pool.id!r} window {k + 1} opens {pool.prefetch_ms} ms before its start; "
            f"it starts in {boundary - now_ms} ms",
            extra={"startsInMs": boundary - now_ms, "prefetchMs": pool.prefetch_ms})
    return k + 1


def check_region(pool: Pool, region: str) -> None:
    if pool.regions is not None and region not in pool.regions:
        raise Forbidden(f"region {region!r} may not lease from pool {pool.id!r}",
                        extra={"allowedRegions": list(pool.regions)})


def demand_chunk(pool: Pool, demand: int, life_ms: int | None = None) -> int:
    """The chunk a region gets: enough for its demand over the lease's life, in [chunkMin, chunkMax].
    ``life_ms``: how long the lease is spendable — the TTL, or less when its expiry is clamped to
    the window's end (default: the TTL). A lease granted near the window's end holds only what the
    region can spend before the end; the rest would be stranded there, unspendable by anyone.

    ``demand == 0`` means "no signal yet" (a region's first request): it gets ``chunkMax``.
    """
    if demand <= 0:
        return pool.chunk_max
    life = pool.lease_ttl_ms if life_ms is None else max(0, min(life_ms, pool.lease_ttl_ms))
    need = -(-demand * life // 1000)  # ceil(tokens/s x life)
    return max(pool.chunk_min, min(pool.chunk_max, need))


def active_regions(state: WindowState, pool: Pool, now_ms: int) -> dict[str, RegionActivity]:
    return {r: a for r, a in state.active.items() if now_ms - a.last_ms <= pool.active_horizon_ms}


DEMAND_HEADROOM = 2  # a demand claim is believed up to this multiple of the region's reported spend rate


def demand_floor(pool: Pool) -> int:
    """The demand (tokens/s) any region may claim without evidence: one full chunk per lease TTL."""
    return -(-pool.chunk_max * 1000 // pool.lease_ttl_ms)


def spend_rate(state: WindowState, previous: WindowState | None, pool: Pool, region: str, now_ms: int) -> int:
    """Tokens/s the region demonstrably spent (its usage reports) over the previous and the
    current window of the pool, rounded up."""
    spent = state.spent.get(region, 0) + (previous.spent.get(region, 0) if previous is not None else 0)
    start = (state.index - (1 if previous is not None else 0)) * pool.window_ms
    return -(-spent * 1000 // max(1, now_ms - start))


def credible_demand(pool: Pool, state: WindowState, previous: WindowState | None, *, region: str, demand: int,
                    now_ms: int) -> int:
    """What a region's claimed ``demand`` counts as: at most ``DEMAND_HEADROOM`` x its reported
    spend rate, and never less than :func:`demand_floor` (a region with no history yet).

    Demand weighs the fair share of a low pool; unchecked, a region claiming an enormous demand
    took the whole remainder. Believing a claim only as far as the region's own usage reports
    support it (reports are the allocator's evidence of spending; a region that reports tokens as
    spent gets none of them back) bounds what inflation can take: with no history, no more than
    the share of a region that claims the floor."""
    if demand <= 0:
        return demand
    cap = max(demand_floor(pool), DEMAND_HEADROOM * spend_rate(state, previous, pool, region, now_ms))
    return min(demand, cap)


def fair_share(state: WindowState, pool: Pool, region: str, now_ms: int) -> int | None:
    """When the pool runs low (remaining < chunkMax x active regions), the region's share of
    what is left, weighted by the active regions' demand (1 at least while anything remains).
    ``None`` when the pool is not low (no fairness cap)."""
    if state.remaining >= pool.chunk_max * max(1, len(state.active)):
        return None  # not low even if every region ever active still were (the common case: no scan)
    active = active_regions(state, pool, now_ms)
    if state.remaining >= pool.chunk_max * max(1, len(active)):
        return None
    if state.remaining <= 0:
        return 0
    weights = {r: max(1, a.demand) for r, a in active.items()}
    total = sum(weights.values())
    share = state.remaining * weights.get(region, 1) // max(1, total)
    return max(1, share)


def lease_times(pool: Pool, index: int, now_ms: int) -> tuple[WindowRef, int, int, int]:
    """(window, expiresAtMs, ttlMs, startsInMs): expiry clamped to the window end; a prefetched
    lease (window not started yet) runs from the window's start."""
    ref = window_ref(index, pool.window_ms)
    start = max(now_ms, ref.start_ms)
    expires = min(start + pool.lease_ttl_ms, ref.end_ms)
    return ref, expires, expires - now_ms, start - now_ms


def decide_grant(pool: Pool, state: WindowState, *, region: str, want: int, demand: int,
                 now_ms: int, previous: WindowState | None = None) -> GrantDecision:
    """give = min(want, chunk(demand), remaining, fair share), with ``demand`` counted as
    :func:`credible_demand` (``previous``: the pool's window before ``state``, if any, for the
    region's spend history); mutates ``state``."""
    check_region(pool, region)
    if state.pool != pool.id:
        raise ValueError(f"window state of pool {state.pool!r} used for pool {pool.id!r}")
    demand = credible_demand(pool, state, previous, region=region, demand=demand, now_ms=now_ms)
    ref, expires, ttl, starts_in = lease_times(pool, state.index, now_ms)
    activity = state.active.get(region)
    if activity is None:
        state.active[region] = RegionActivity(last_ms=now_ms, demand=demand)
    else:  # updated in place (the committer decides on the cached state itself)
        activity.last_ms, activity.demand = now_ms, demand
    give = min(want, demand_chunk(pool, demand, ttl - starts_in), state.remaining)
    share = fair_share(state, pool, region, now_ms)
    if share is not None:
        give = min(give, share)
    if ttl <= 0:
        give = 0  # the window is over: nothing can be spent in it
    give = max(0, give)
    before = state.remaining
    if give:
        state.remaining -= give
        state.granted[region] = state.granted.get(region, 0) + give
        state.leases[region] = state.leases.get(region, 0) + 1
    exhausted_now = before > 0 and state.remaining == 0
    if exhausted_now:
        state.exhausted = True
    return GrantDecision(granted=give, window=ref, expires_at_ms=expires, ttl_ms=max(0, ttl),
                         starts_in_ms=starts_in, remaining=state.remaining, exhausted_now=exhausted_now)


def replay_view(grant: LeaseGrant, now_ms: int) -> LeaseGrant:
    """A stored grant answered again for a retried leaseId: every field as stored (granted,
    window, expiresAtMs, epoch, issuedAtMs, remaining) and ``replayed=True``, except the two
    *relative* timings, which are recomputed for this answer: the region times ``ttlMs`` from when
    it sent *this* request, so the stored ttl would let a late retry spend past ``expiresAtMs``
    (and past the window end). Both only ever shrink."""
    return msgspec.structs.replace(
        grant, replayed=True,
        ttl_ms=max(0, min(grant.ttl_ms, grant.expires_at_ms - now_ms)),
        starts_in_ms=max(0, min(grant.starts_in_ms, grant.window.start_ms - now_ms)))


def decide_reclaim(*, granted: int, spent: int, expires_at_ms: int, window_end_ms: int,
                   now_ms: int, closed_early: bool = False) -> ReclaimDecision:
    """Validate a usage report and say how many unspent tokens go back to the pool.

    Accepted after the lease expired on the allocator clock (the region stopped spending before
    that), or before that when the region says it closed the lease in its store (``closed_early``:
    an agent shutting down removed it, so nothing more is spent from it) — either way returning
    ``granted - spent`` to a still-open window cannot overshoot. (The allocator trusts a region's
    report in both cases: a region that reports less than it spent overshoots either way.)
    """
    if spent > granted:
        raise ValidationFailed(f"spent {spent} exceeds the {granted} tokens granted",
                               errors=[f"spent: must be <= {granted}"])
    if now_ms < expires_at_ms and not closed_early:
        raise Conflict(f"lease not yet expired: it expires in {expires_at_ms - now_ms} ms; "
                       "report usage after expiry", extra={"expiresInMs": expires_at_ms - now_ms})
    unspent = granted - spent
    if now_ms < window_end_ms:
        return ReclaimDecision(returned=unspent, stranded=0, window_open=True)
    return ReclaimDecision(returned=0, stranded=unspent, window_open=False)


def apply_reclaim(state: WindowState, region: str, returned: int, granted: int = 0, spent: int = 0) -> None:
    """Record a usage report of a lease of ``granted`` tokens of which ``spent`` were spent, and
    give ``returned`` tokens back to the window (0 once it has closed). Mutates ``state``."""
    if returned < 0 or (granted and returned > granted) or state.remaining + returned > state.limit:
        raise ValueError("reclaim would break remaining <= limit")
    if spent < 0 or (granted and spent > granted):
        raise ValueError("spent must be within the lease")
    state.remaining += returned
    if spent:
        state.spent[region] = state.spent.get(region, 0) + spent
    state.returned[region] = state.returned.get(region, 0) + returned
    state.reported[region] = state.reported.get(region, 0) + 1
    state.reported_tokens[region] = state.reported_tokens.get(region, 0) + granted


def unreported_tokens(state: WindowState) -> dict[str, int]:
    """Per region, tokens of leases never reported: expired, spent or stranded (unknown)."""
    return {r: g - state.reported_tokens.get(r, 0) for r, g in state.granted.items()
            if g > state.reported_tokens.get(r, 0)}
