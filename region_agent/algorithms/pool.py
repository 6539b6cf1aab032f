"""Leased global-pool tokens parked in the tenant's hash; mirrors ``lua/lib/pool.lua`` and the
deposit / close scripts. Entries are spendable while valid_from <= now < expires_at and they
were written in the node's current incarnation (its ``master_replid``: an entry of another one
was restored from an older state and may have lost debits); a spend debits the earliest-expiring
valid lease first (ties by lease id), splitting across leases. ``incarnation`` is passed in (the
script reads INFO replication)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .common import Decision, check_int

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class PoolEntry:
    granted: int
    spent: int
    valid_from_ms: int
    expires_at_ms: int
    incarnation: str = ""  # the node's master_replid when deposited

    @staticmethod
    def decode(value: str) -> PoolEntry | None:
        parts = value.split(",")
        if len(parts) != 5 or not all(p.isdigit() for p in parts[:4]) or not _HEX.fullmatch(parts[4]):
            return None
        return PoolEntry(*(int(p) for p in parts[:4]), parts[4])

    def encode(self) -> str:
        return f"{self.granted},{self.spent},{self.valid_from_ms},{self.expires_at_ms},{self.incarnation}"

    def valid_at(self, now_ms: int, incarnation: str = "") -> bool:
        return self.incarnation == incarnation and self.valid_from_ms <= now_ms < self.expires_at_ms


@dataclass(frozen=True, slots=True)
class PoolParams:
    cost: int  # tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", check_int(self.cost, 1, name="cost"))

    @classmethod
    def from_args(cls, p: tuple) -> PoolParams:
        return cls(p[0])


@dataclass(frozen=True, slots=True)
class PoolState:
    entries: Mapping[str, PoolEntry] = field(default_factory=dict)


def spendable(state: PoolState | None, now_ms: int, incarnation: str = "") -> int:
    if state is None:
        return 0
    return sum(e.granted - e.spent for e in state.entries.values()
               if e.valid_at(now_ms, incarnation) and e.granted > e.spent)


def decide(state: PoolState | None, params: PoolParams, now_ms: int, incarnation: str = ""
           ) -> tuple[Decision, PoolState | None]:
    entries = dict(state.entries) if state else {}
    have = spendable(state, now_ms, incarnation)
    if have < params.cost:
        future = [e.valid_from_ms for e in entries.values()
                  if e.incarnation == incarnation and e.valid_from_ms > now_ms]
        return Decision(False, have, (min(future) - now_ms) if future else 0), None
    valid = sorted(((e.expires_at_ms, lid) for lid, e in entries.items()
                    if e.valid_at(now_ms, incarnation) and e.granted > e.spent))
    left = params.cost
    for _, lid in valid:
        if left == 0:
            break
        e = entries[lid]
        take = min(left, e.granted - e.spent)
        entries[lid] = replace(e, spent=e.spent + take)
        left -= take
    return Decision(True, have - params.cost, 0, have), PoolState(entries)


def take(state: PoolState | None, min_tokens: int, want: int, now_ms: int, incarnation: str = ""
         ) -> tuple[tuple[int, int, int, int], PoolState | None]:
    """``pool_take.lua``: ((taken, remaining, valid_for_ms, next_from_ms), new state or None)."""
    check_int(min_tokens, 1, name="min")
    check_int(want, min_tokens, name="want")
    d, new = decide(state, PoolParams(want), now_ms, incarnation)
    if not d.allowed and d.remaining >= min_tokens:
        d, new = decide(state, PoolParams(d.remaining), now_ms, incarnation)
    if not d.allowed or new is None:
        return (0, d.remaining, 0, d.retry_after_ms), None
    before = state.entries if state else {}
    debited = [e for lid, e in new.entries.items() if before.get(lid) != e]
    until = min(e.expires_at_ms for e in debited)
    return (d.undebited - d.remaining, d.remaining, until - now_ms, 0), new


def deposit(state: PoolState | None, lease_id: str, granted: int, valid_from_ms: int, expires_at_ms: int,
            max_entries: int, now_ms: int, incarnation: str = "") -> tuple[str, PoolState | None]:
    """('stored' | 'replay' | 'full' | 'expired', new state or None when unchanged)."""
    check_int(granted, 0, name="granted")
    entries = dict(state.entries) if state else {}
    if lease_id in entries:
        return "replay", None
    if expires_at_ms <= now_ms:
        return "expired", None
    if len(entries) >= max_entries:
        return "full", None
    entries[lease_id] = PoolEntry(granted, 0, valid_from_ms, expires_at_ms, incarnation)
    return "stored", PoolState(entries)


def close(state: PoolState | None, lease_id: str, incarnation: str = ""
          ) -> tuple[tuple[int, int, bool] | None, PoolState | None]:
    """((granted, spent, current), new state) or (None, None) when absent; ``current`` False =
    restored from an older incarnation (its spent count may be too low)."""
    entries = dict(state.entries) if state else {}
    e = entries.pop(lease_id, None)
    if e is None:
        return None, None
    return (e.granted, e.spent, e.incarnation == incarnation), PoolState(entries)


def expiry_ms(state: PoolState, now_ms: int, slack_ms: int) -> int:
    return max(e.expires_at_ms for e in state.entries.values()) - now_ms + slack_ms
