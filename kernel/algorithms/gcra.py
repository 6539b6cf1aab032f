"""GCRA in integer ms: the rule (:class:`GcraRule`, the token bucket's parameters) and
its reference model, which mirrors ``lua/lib/gcra.lua``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .common import NEVER, Kind, RuleVerdict, ceil_div, register_kind
from .rule import algorithm
from .token_bucket import BucketRule
from .token_bucket import TokenBucketParams as GcraParams

__all__ = ["GcraParams", "GcraRule", "GcraState", "decide", "increment_ms", "burst_ms"]


@dataclass(frozen=True, slots=True)
class GcraState:
    tat: int  # theoretical arrival time, Unix ms


def increment_ms(p: GcraParams) -> int:
    return ceil_div(p.cost * p.period_ms, p.refill)


def burst_ms(p: GcraParams) -> int:
    return p.capacity * p.period_ms // p.refill


def _remaining(p: GcraParams, burst: int, ahead: int) -> int:
    return max(0, (burst - ahead) * p.refill // p.period_ms)


def decide(state: GcraState | None, params: GcraParams, now_ms: int) -> tuple[RuleVerdict, GcraState | None]:
    p = params
    inc, burst = increment_ms(p), burst_ms(p)
    if p.cost > p.capacity or inc > burst:
        return NEVER, None
    tat = now_ms if state is None else state.tat
    start = max(tat, now_ms)
    new_tat = start + inc
    if new_tat - now_ms > burst:
        return RuleVerdict(False, _remaining(p, burst, start - now_ms), new_tat - now_ms - burst), None
    d = RuleVerdict(True, _remaining(p, burst, new_tat - now_ms), 0, _remaining(p, burst, start - now_ms))
    return d, GcraState(new_tat)


def expiry_ms(state: GcraState, now_ms: int, slack_ms: int) -> int:
    return state.tat - now_ms + slack_ms


KIND = register_kind(Kind("gcra", "GCRA", "lib/gcra.lua", GcraParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now)))


@algorithm
class GcraRule(BucketRule, frozen=True, tag="gcra"):
    """GCRA with the token bucket's parameters and units."""

    kind: ClassVar[Kind] = KIND
