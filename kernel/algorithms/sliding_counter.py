"""Sliding-window approximate counter in integers: the rule
(:class:`SlidingCounterRule`, a :class:`~.fixed_window.WindowRule`) and its reference model, which
mirrors ``lua/lib/sliding_counter.lua``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .common import NEVER, Kind, RuleVerdict, ceil_div, register_kind
from .fixed_window import WindowParams, WindowRule
from .rule import algorithm

SlidingCounterParams = WindowParams


@dataclass(frozen=True, slots=True)
class SlidingCounterState:
    w: int  # current window start, Unix ms
    cur: int
    prev: int


def _retry(p: WindowParams, ew: int, now: int, elapsed: int, prev: int, cur: int, scaled: int) -> int:
    """Smallest whole ms after which the same request would be admitted (no other traffic)."""
    W = p.window_ms
    lag = max(0, ew - now)
    if prev > 0:
        k = ceil_div(scaled + p.cost * W - p.limit * W, prev)
        if elapsed + k < W:
            return lag + k
    t0 = ew + W - now
    ex2 = cur * W + p.cost * W - p.limit * W
    if ex2 <= 0:
        return t0
    return t0 + min(ceil_div(ex2, cur), W)


def decide(state: SlidingCounterState | None, params: WindowParams, now_ms: int
           ) -> tuple[RuleVerdict, SlidingCounterState | None]:
    p = params
    if p.cost > p.limit:
        return NEVER, None
    W = p.window_ms
    w = now_ms - now_ms % W
    cur = prev = 0
    if state is not None:
        if state.w >= w:
            w, cur, prev = state.w, state.cur, state.prev
        elif w - state.w < 2 * W:
            prev, cur = state.cur, 0
    cur = max(0, min(cur, p.limit))
    prev = max(0, min(prev, p.limit))
    elapsed = max(0, now_ms - w)
    scaled = prev * (W - elapsed) + cur * W
    cap = p.limit * W
    if scaled + p.cost * W > cap:
        return RuleVerdict(False, max(0, (cap - scaled) // W), _retry(p, w, now_ms, elapsed, prev, cur, scaled)), None
    return RuleVerdict(True, (cap - scaled - p.cost * W) // W, 0, (cap - scaled) // W), SlidingCounterState(w, cur + p.cost, prev)


def expiry_ms(state: SlidingCounterState, params: WindowParams, now_ms: int, slack_ms: int) -> int:
    return state.w + 2 * params.window_ms - now_ms + slack_ms


KIND = register_kind(Kind("sc", "SC", "lib/sliding_counter.lua", WindowParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now)))


@algorithm
class SlidingCounterRule(WindowRule, frozen=True, tag="sliding_counter"):
    kind: ClassVar[Kind] = KIND
