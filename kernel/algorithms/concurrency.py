"""Concurrency cap; mirrors ``lua/lib/concurrency.lua`` and the acquire / release /
renew scripts. State: slot id -> slot expiry (Unix ms); live slots have expiry > now.
The RuleVerdict's ``remaining`` carries in_flight (after the acquire when allowed); a denial has
no time-based hint (retry 0)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .common import InvalidArguments, Kind, RuleVerdict, check_int, register_kind


@dataclass(frozen=True, slots=True)
class ConcurrencyParams:
    max_in_flight: int
    slot_ttl_ms: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_in_flight", check_int(self.max_in_flight, 1, name="max_in_flight"))
        object.__setattr__(self, "slot_ttl_ms", check_int(self.slot_ttl_ms, 1, name="slot_ttl_ms"))

    @classmethod
    def from_args(cls, p: tuple[int, ...]) -> ConcurrencyParams:
        return cls(p[0], p[1])


@dataclass(frozen=True, slots=True)
class ConcurrencyState:
    slots: Mapping[str, int] = field(default_factory=dict)


def _live(state: ConcurrencyState | None, now_ms: int) -> dict[str, int]:
    return {m: s for m, s in (state.slots if state else {}).items() if s > now_ms}


def acquire(state: ConcurrencyState | None, params: ConcurrencyParams, now_ms: int, slot_id: str
            ) -> tuple[RuleVerdict, ConcurrencyState | None]:
    """New state None when nothing is written (denial, or the slot is already held)."""
    if not slot_id:
        raise InvalidArguments("slot id must be non-empty")
    live = _live(state, now_ms)
    if slot_id in live:
        return RuleVerdict(True, len(live), 0), None
    if len(live) >= params.max_in_flight:
        return RuleVerdict(False, len(live), 0), None
    before = len(live)
    live[slot_id] = now_ms + params.slot_ttl_ms
    return RuleVerdict(True, len(live), 0, before), ConcurrencyState(live)


decide = acquire

# the gate riding on a rule (not a bundle algorithm): its slot id is the decision id
KIND = register_kind(Kind("cc", "CC", "lib/concurrency.lua", ConcurrencyParams.from_args,
                          lambda s, p, now, member, inc: acquire(s, p, now, member), needs_member=True))


def release(state: ConcurrencyState | None, now_ms: int, slot_id: str
            ) -> tuple[bool, int, ConcurrencyState | None]:
    """(released, in_flight, new state): released when a live slot was freed (an expired one is
    removed too, but it held nothing); new state None when nothing was removed."""
    slots = dict(state.slots) if state else {}
    if slot_id not in slots:
        return False, len(_live(state, now_ms)), None
    expiry = slots.pop(slot_id)
    live = {m: s for m, s in slots.items() if s > now_ms}
    return expiry > now_ms, len(live), ConcurrencyState(live)


def renew(state: ConcurrencyState | None, params: ConcurrencyParams, now_ms: int, slot_id: str
          ) -> tuple[bool, int, ConcurrencyState | None]:
    live = _live(state, now_ms)
    if slot_id not in live:
        return False, len(live), None
    live[slot_id] = max(live[slot_id], now_ms + params.slot_ttl_ms)
    return True, len(live), ConcurrencyState(live)


def expiry_ms(state: ConcurrencyState, now_ms: int) -> int:
    return max(state.slots.values()) - now_ms
