"""Concurrency cap; mirrors ``lua/lib/concurrency.lua`` and the acquire / release /
renew scripts. State: lease id -> lease expiry (Unix ms); live leases have expiry > now.
The RuleVerdict's ``remaining`` carries in_flight (after the acquire when allowed); a denial has
no time-based hint (retry 0)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .common import InvalidArguments, Kind, RuleVerdict, check_int, register_kind


@dataclass(frozen=True, slots=True)
class ConcurrencyParams:
    max_in_flight: int
    lease_ttl_ms: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_in_flight", check_int(self.max_in_flight, 1, name="max_in_flight"))
        object.__setattr__(self, "lease_ttl_ms", check_int(self.lease_ttl_ms, 1, name="lease_ttl_ms"))

    @classmethod
    def from_args(cls, p: tuple[int, ...]) -> ConcurrencyParams:
        return cls(p[0], p[1])


@dataclass(frozen=True, slots=True)
class ConcurrencyState:
    leases: Mapping[str, int] = field(default_factory=dict)


def _live(state: ConcurrencyState | None, now_ms: int) -> dict[str, int]:
    return {m: s for m, s in (state.leases if state else {}).items() if s > now_ms}


def acquire(state: ConcurrencyState | None, params: ConcurrencyParams, now_ms: int, lease_id: str
            ) -> tuple[RuleVerdict, ConcurrencyState | None]:
    """New state None when nothing is written (denial, or the lease is already held)."""
    if not lease_id:
        raise InvalidArguments("lease id must be non-empty")
    live = _live(state, now_ms)
    if lease_id in live:
        return RuleVerdict(True, len(live), 0), None
    if len(live) >= params.max_in_flight:
        return RuleVerdict(False, len(live), 0), None
    before = len(live)
    live[lease_id] = now_ms + params.lease_ttl_ms
    return RuleVerdict(True, len(live), 0, before), ConcurrencyState(live)


decide = acquire

# the gate riding on a rule (not a bundle algorithm): its lease id is the decision id
KIND = register_kind(Kind("cc", "CC", "lib/concurrency.lua", ConcurrencyParams.from_args,
                          lambda s, p, now, member, inc: acquire(s, p, now, member), needs_member=True))


def release(state: ConcurrencyState | None, now_ms: int, lease_id: str
            ) -> tuple[bool, int, ConcurrencyState | None]:
    """(released, in_flight, new state); new state None when nothing was removed."""
    leases = dict(state.leases) if state else {}
    if lease_id not in leases:
        return False, len(_live(state, now_ms)), None
    del leases[lease_id]
    live = {m: s for m, s in leases.items() if s > now_ms}
    return True, len(live), ConcurrencyState(live)


def renew(state: ConcurrencyState | None, params: ConcurrencyParams, now_ms: int, lease_id: str
          ) -> tuple[bool, int, ConcurrencyState | None]:
    live = _live(state, now_ms)
    if lease_id not in live:
        return False, len(live), None
    live[lease_id] = max(live[lease_id], now_ms + params.lease_ttl_ms)
    return True, len(live), ConcurrencyState(live)


def expiry_ms(state: ConcurrencyState, now_ms: int) -> int:
    return max(state.leases.values()) - now_ms
