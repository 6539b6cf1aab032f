"""Fixed window (seed ch.3), aligned to epoch multiples; mirrors ``lua/lib/fixed_window.lua``."""

from __future__ import annotations

from dataclasses import dataclass

from .common import NEVER, Decision, check_int, check_product


@dataclass(frozen=True, slots=True)
class WindowParams:
    limit: int  # units per window
    window_ms: int
    cost: int = 1

    def __post_init__(self) -> None:
        for name in ("limit", "window_ms", "cost"):
            object.__setattr__(self, name, check_int(getattr(self, name), 1, name=name))
        check_product(self.limit, self.window_ms, "limit x window")

    @classmethod
    def from_args(cls, p: tuple) -> WindowParams:
        return cls(p[0], p[1], p[2])


FixedWindowParams = WindowParams


@dataclass(frozen=True, slots=True)
class FixedWindowState:
    w: int  # window start, epoch ms
    n: int  # units admitted in w


def decide(state: FixedWindowState | None, params: WindowParams, now_ms: int
           ) -> tuple[Decision, FixedWindowState | None]:
    p = params
    if p.cost > p.limit:
        return NEVER, None
    w = now_ms - now_ms % p.window_ms
    n = 0
    if state is not None and state.w >= w:  # a future window (clock went back) stays current
        w, n = state.w, state.n
    ms_left = w + p.window_ms - now_ms
    if n + p.cost > p.limit:
        return Decision(False, max(0, p.limit - n), ms_left), None
    return Decision(True, p.limit - n - p.cost, 0, p.limit - n), FixedWindowState(w, n + p.cost)


def expiry_ms(state: FixedWindowState, params: WindowParams, now_ms: int, slack_ms: int) -> int:
    return state.w + params.window_ms - now_ms + slack_ms
