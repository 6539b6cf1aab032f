"""Token bucket in millitokens and ms: the rule (:class:`TokenBucketRule`) and its
reference model, which mirrors ``lua/lib/token_bucket.lua``. :class:`BucketRule` holds what the
token bucket and GCRA (same parameters) share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .common import NEVER, Kind, RuleVerdict, ceil_div, check_int, check_product, register_kind
from .rule import MAX_PRODUCT, Params, PosInt, Rate, RuleBase, algorithm, missing

if TYPE_CHECKING:
    from kernel.bundle import Pool


@dataclass(frozen=True, slots=True)
class TokenBucketParams:
    capacity: int  # millitokens
    refill: int  # millitokens per period
    period_ms: int
    cost: int  # millitokens

    def __post_init__(self) -> None:
        for name in ("capacity", "refill", "period_ms", "cost"):
            object.__setattr__(self, name, check_int(getattr(self, name), 1, name=name))
        check_product(self.capacity, self.period_ms, "capacity x period")

    @property
    def full_ms(self) -> int:
        return ceil_div(self.capacity * self.period_ms, self.refill)

    @classmethod
    def from_args(cls, p: tuple[int, ...]) -> TokenBucketParams:
        return cls(p[0], p[1], p[2], p[3])


@dataclass(frozen=True, slots=True)
class TokenBucketState:
    tokens: int  # millitokens
    ts: int  # Unix ms of the last write


def decide(state: TokenBucketState | None, params: TokenBucketParams, now_ms: int
           ) -> tuple[RuleVerdict, TokenBucketState | None]:
    """New state None on deny (nothing written)."""
    p = params
    if p.cost > p.capacity:
        return NEVER, None
    tokens, ts = (p.capacity, now_ms) if state is None else (state.tokens, state.ts)
    delta = min(max(0, now_ms - ts), p.full_ms)
    tokens = max(0, min(p.capacity, tokens))
    tokens = min(p.capacity, tokens + delta * p.refill // p.period_ms)
    if tokens >= p.cost:
        left = tokens - p.cost
        return RuleVerdict(True, left, 0, tokens), TokenBucketState(left, max(ts, now_ms))
    return RuleVerdict(False, tokens, ceil_div((p.cost - tokens) * p.period_ms, p.refill)), None


def expiry_ms(params: TokenBucketParams, slack_ms: int) -> int:
    return params.full_ms + slack_ms


KIND = register_kind(Kind("tb", "TB", "lib/token_bucket.lua", TokenBucketParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now)))


# --- the rule ---------------------------------------------------------------------------------
class BucketRule(RuleBase, frozen=True):
    """Millitokens and ms: ``capacityMillis`` refilled by ``refillMillis`` per ``periodMs``, a
    request costs ``costMillis`` per unit of its costHint."""

    millis: ClassVar[int] = 1000
    capacity_millis: PosInt | None = None
    refill_millis: PosInt | None = None
    period_ms: PosInt | None = None
    cost_millis: PosInt | None = None

    def problems(self, pools: Mapping[str, Pool]) -> list[str]:
        p = missing(self.algorithm, {"capacityMillis": self.capacity_millis, "refillMillis": self.refill_millis,
                                     "periodMs": self.period_ms, "costMillis": self.cost_millis})
        if p:
            return p
        capacity, period, cost = self.capacity_millis or 0, self.period_ms or 0, self.cost_millis or 0
        if cost > capacity:
            p.append(f"costMillis {cost} exceeds capacityMillis {capacity}: the request could never succeed")
        if capacity * period > MAX_PRODUCT:
            p.append("capacityMillis x periodMs must be at most 2^52")
        return p

    def script_params(self, cost_hint: int) -> Params:
        return (self.capacity_millis or 0, self.refill_millis or 0, self.period_ms or 0,
                (self.cost_millis or 0) * cost_hint, 0)

    def limit_tokens(self, pools: Mapping[str, Pool]) -> int:
        return (self.capacity_millis or 0) // 1000

    def policy_window_ms(self, pools: Mapping[str, Pool]) -> int:
        if not self.refill_millis:
            return 0
        return ceil_div((self.capacity_millis or 0) * (self.period_ms or 0), self.refill_millis)

    def rate(self, pools: Mapping[str, Pool]) -> Rate:
        return Rate(self.refill_millis or 0, self.period_ms or 0, True)

    def capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        cost = self.cost_millis or 1
        return (self.refill_millis or 0) * 1000 / (self.period_ms or 1) / cost, (self.capacity_millis or 0) / cost

    def fallback_cost_millis(self, cost_hint: int) -> int:
        return (self.cost_millis or 1000) * cost_hint


@algorithm
class TokenBucketRule(BucketRule, frozen=True, tag="token_bucket"):
    kind: ClassVar[Kind] = KIND
