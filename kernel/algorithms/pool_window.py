"""A pool's fallback allowance counted per allocator window; mirrors ``lua/lib/pool_window.lua``.

The caller passes the allocator window indexes ``[k_lo, k_hi]`` a decision may fall in (its
offset to the allocator's clock is known only within bounds); every candidate is charged, so
each allocator window's count stays <= limit whichever window the decision really fell in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .common import NEVER, InvalidArguments, Kind, RuleVerdict, check_int, register_kind

MAX_SPAN = 8  # candidate windows per call
KEEP = 3  # windows before k_lo whose counts are kept


@dataclass(frozen=True, slots=True)
class PoolWindowParams:
    limit: int
    k_lo: int
    k_hi: int
    cost: int
    ttl_ms: int

    def __post_init__(self) -> None:
        for name, lo in (("limit", 1), ("k_lo", 0), ("k_hi", 0), ("cost", 1), ("ttl_ms", 1)):
            object.__setattr__(self, name, check_int(getattr(self, name), lo, name=name))
        if not 0 <= self.k_hi - self.k_lo < MAX_SPAN:
            raise InvalidArguments(f"k_hi - k_lo must be in [0, {MAX_SPAN})")

    @classmethod
    def from_args(cls, p: tuple[int, ...]) -> PoolWindowParams:
        return cls(p[0], p[1], p[2], p[3], p[4])


@dataclass(frozen=True, slots=True)
class PoolWindowState:
    counts: Mapping[int, int] = field(default_factory=dict)  # allocator window -> tokens admitted
    expires_at_ms: int = 0


def decide(state: PoolWindowState | None, p: PoolWindowParams, now_ms: int
           ) -> tuple[RuleVerdict, PoolWindowState | None]:
    """The check; on allow the new counts and expiry (the latest any caller asked for)."""
    if p.cost > p.limit:
        return NEVER, None
    counts = dict(state.counts) if state else {}
    room = min(p.limit - counts.get(k, 0) for k in range(p.k_lo, p.k_hi + 1))
    if room < p.cost:
        return RuleVerdict(False, max(0, room), 0), None
    for k in range(p.k_lo, p.k_hi + 1):
        counts[k] = counts.get(k, 0) + p.cost
    counts = {k: n for k, n in counts.items() if k >= p.k_lo - KEEP}
    expires = max(state.expires_at_ms if state else 0, now_ms + p.ttl_ms)
    return RuleVerdict(True, room - p.cost, 0, room), PoolWindowState(counts, expires)


# a pool's fallback allowance (not a bundle algorithm: the agent charges it for pool rules)
KIND = register_kind(Kind("pw", "PW", "lib/pool_window.lua", PoolWindowParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now)))
