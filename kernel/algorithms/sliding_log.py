"""Sliding-window log: the rule (:class:`SlidingLogRule`, a
:class:`~.fixed_window.WindowRule`) and its reference model, which mirrors ``lua/lib/sliding_log.lua``.

State is the sorted set as a mapping member -> score (admit ms). A cost c > 1 is stored as c
entries ``member``, ``member#2`` .. ``member#c``. Live window: score > now - W (scores after now,
left by a clock that went backwards, count too)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from .common import NEVER, InvalidArguments, Kind, RuleVerdict, check_int, register_kind
from .fixed_window import WindowParams, WindowRule
from .rule import algorithm

SlidingLogParams = WindowParams
MAX_COST = 1_000  # entries one request may add (the script refuses more)


@dataclass(frozen=True, slots=True)
class SlidingLogState:
    entries: Mapping[str, int] = field(default_factory=dict)


def entry_members(member: str, cost: int) -> list[str]:
    return [member] + [f"{member}#{i}" for i in range(2, cost + 1)]


def decide(state: SlidingLogState | None, params: WindowParams, now_ms: int, member: str
           ) -> tuple[RuleVerdict, SlidingLogState | None]:
    """New state None on deny and on a replay (nothing written)."""
    p = params
    if not member:
        raise InvalidArguments("member must be non-empty")
    if p.cost > MAX_COST:
        raise InvalidArguments(f"a sliding-log cost is at most {MAX_COST} entries")
    if p.cost > p.limit:
        return NEVER, None
    entries = dict(state.entries) if state is not None else {}
    floor_ = now_ms - p.window_ms
    live = sorted(s for s in entries.values() if s > floor_)
    own = entries.get(member)
    if own is not None and own > floor_:
        return RuleVerdict(True, max(0, p.limit - len(live)), 0), None
    if len(live) + p.cost > p.limit:
        k = len(live) + p.cost - p.limit
        return RuleVerdict(False, max(0, p.limit - len(live)), live[k - 1] + p.window_ms - now_ms), None
    kept = {m: s for m, s in entries.items() if s > floor_}
    for m in entry_members(member, p.cost):
        kept[m] = now_ms
    return RuleVerdict(True, p.limit - len(live) - p.cost, 0, p.limit - len(live)), SlidingLogState(kept)


def expiry_ms(state: SlidingLogState, params: WindowParams, now_ms: int, slack_ms: int) -> int:
    top = max([now_ms, *state.entries.values()])
    return top + params.window_ms - now_ms + slack_ms


def parse(p: tuple[int, ...]) -> WindowParams:
    """The five ARGV parameters, refused beyond ``lib/sliding_log.lua``'s range (a cost above
    :data:`MAX_COST` too, as its ``SL.parse`` refuses it: a chunk's search counts such a count denied)."""
    check_int(p[2], 1, MAX_COST, name="cost")
    return WindowParams.from_args(p)


KIND = register_kind(Kind("sl", "SL", "lib/sliding_log.lua", parse,
                          lambda s, p, now, member, inc: decide(s, p, now, member), needs_member=True))


@algorithm
class SlidingLogRule(WindowRule, frozen=True, tag="sliding_log"):
    """One sorted-set entry per admitted unit (a cost is at most ``MAX_COST`` entries)."""

    kind: ClassVar[Kind] = KIND
