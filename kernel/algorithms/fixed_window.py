"""Fixed window, aligned to multiples of their length in Unix time: the rule (:class:`FixedWindowRule`) and its
reference model, which mirrors ``lua/lib/fixed_window.lua``. :class:`WindowRule` holds what the
three window algorithms (fixed window, sliding counter, sliding log) share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .common import NEVER, Kind, RuleVerdict, check_int, check_product, register_kind
from .rule import MAX_PRODUCT, Params, PosInt, Rate, RuleBase, algorithm, missing

if TYPE_CHECKING:
    from kernel.bundle import Pool


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
    def from_args(cls, p: tuple[int, ...]) -> WindowParams:
        return cls(p[0], p[1], p[2])


FixedWindowParams = WindowParams


@dataclass(frozen=True, slots=True)
class FixedWindowState:
    w: int  # window start, Unix ms
    n: int  # units admitted in w


def decide(state: FixedWindowState | None, params: WindowParams, now_ms: int
           ) -> tuple[RuleVerdict, FixedWindowState | None]:
    p = params
    if p.cost > p.limit:
        return NEVER, None
    w = now_ms - now_ms % p.window_ms
    n = 0
    if state is not None and state.w >= w:  # a future window (clock went back) stays current
        w, n = state.w, state.n
    ms_left = w + p.window_ms - now_ms
    if n + p.cost > p.limit:
        return RuleVerdict(False, max(0, p.limit - n), ms_left), None
    return RuleVerdict(True, p.limit - n - p.cost, 0, p.limit - n), FixedWindowState(w, n + p.cost)


def expiry_ms(state: FixedWindowState, params: WindowParams, now_ms: int, slack_ms: int) -> int:
    return state.w + params.window_ms - now_ms + slack_ms


KIND = register_kind(Kind("fw", "FW", "lib/fixed_window.lua", WindowParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now)))


# --- the rule ---------------------------------------------------------------------------------
class WindowRule(RuleBase, frozen=True):
    """Whole requests: ``limit`` per ``windowMs``; a request counts its costHint."""

    limit: PosInt | None = None
    window_ms: PosInt | None = None

    def problems(self, pools: Mapping[str, Pool]) -> list[str]:
        p = missing(self.algorithm, {"limit": self.limit, "windowMs": self.window_ms})
        if not p and (self.limit or 0) * (self.window_ms or 0) > MAX_PRODUCT:
            p.append("limit x windowMs must be at most 2^52")
        return p

    def script_params(self, cost_hint: int) -> Params:
        return (self.limit or 0, self.window_ms or 0, cost_hint, 0, 0)

    def limit_tokens(self, pools: Mapping[str, Pool]) -> int:
        return self.limit or 0

    def policy_window_ms(self, pools: Mapping[str, Pool]) -> int:
        return self.window_ms or 0

    def rate(self, pools: Mapping[str, Pool]) -> Rate:
        return Rate((self.limit or 0) * 1000, self.window_ms or 0, False)

    def capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        limit = self.limit or 0
        return limit * 1000 / (self.window_ms or 1), float(limit)


@algorithm
class FixedWindowRule(WindowRule, frozen=True, tag="fixed_window"):
    kind: ClassVar[Kind] = KIND
