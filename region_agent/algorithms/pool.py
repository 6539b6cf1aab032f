"""Leased global-pool tokens parked in the tenant's hash; mirrors ``lua/lib/pool.lua`` and the
deposit / close scripts. Entries are spendable while valid_from <= now < expires_at; a spend
debits the earliest-expiring valid lease first (ties by lease id), splitting across leases."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from .common import Decision, check_int


@dataclass(frozen=True, slots=True)
class PoolEntry:
    granted: int
    spent: int
    valid_from_ms: int
    expires_at_ms: int

    @staticmethod
    def decode(value: str) -> PoolEntry | None:
        parts = value.split(",")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            return None
        return PoolEntry(*(int(p) for p in parts))

    def encode(self) -> str:
        return f"{self.granted},{self.spent},{self.valid_from_ms},{self.expires_at_ms}"

    def valid_at(self, now_ms: int) -> bool:
        return self.valid_from_ms <= now_ms < self.expires_at_ms


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


def spendable(state: PoolState | None, now_ms: int) -> int:
    if state is None:
        return 0
    return sum(e.granted - e.spent for e in state.entries.values() if e.valid_at(now_ms) and e.granted > e.spent)


def decide(state: PoolState | None, params: PoolParams, now_ms: int) -> tuple[Decision, PoolState | None]:
    entries = dict(state.entries) if state else {}
    have = spendable(state, now_ms)
    if have < params.cost:
        future = [e.valid_from_ms for e in entries.values() if e.valid_from_ms > now_ms]
        return Decision(False, have, (min(future) - now_ms) if future else 0), None
    valid = sorted(((e.expires_at_ms, lid) for lid, e in entries.items()
                    if e.valid_at(now_ms) and e.granted > e.spent))
    left = params.cost
    for _, lid in valid:
        if left == 0:
            break
        e = entries[lid]
        take = min(left, e.granted - e.spent)
        entries[lid] = replace(e, spent=e.spent + take)
        left -= take
    return Decision(True, have - params.cost, 0, have), PoolState(entries)


def deposit(state: PoolState | None, lease_id: str, granted: int, valid_from_ms: int, expires_at_ms: int,
            max_entries: int, now_ms: int) -> tuple[str, PoolState | None]:
    """('stored' | 'replay' | 'full' | 'expired', new state or None when unchanged)."""
    check_int(granted, 0, name="granted")
    entries = dict(state.entries) if state else {}
    if lease_id in entries:
        return "replay", None
    if expires_at_ms <= now_ms:
        return "expired", None
    if len(entries) >= max_entries:
        return "full", None
    entries[lease_id] = PoolEntry(granted, 0, valid_from_ms, expires_at_ms)
    return "stored", PoolState(entries)


def close(state: PoolState | None, lease_id: str) -> tuple[tuple[int, int] | None, PoolState | None]:
    entries = dict(state.entries) if state else {}
    e = entries.pop(lease_id, None)
    if e is None:
        return None, None
    return (e.granted, e.spent), PoolState(entries)


def expiry_ms(state: PoolState, now_ms: int, slack_ms: int) -> int:
    return max(e.expires_at_ms for e in state.entries.values()) - now_ms + slack_ms
