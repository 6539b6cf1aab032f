"""Token bucket (seed ch.6/8) in millitokens and ms; mirrors ``lua/lib/token_bucket.lua``."""

from __future__ import annotations

from dataclasses import dataclass

from .common import NEVER, Decision, ceil_div, check_int, check_product


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
    def from_args(cls, p: tuple) -> TokenBucketParams:
        return cls(p[0], p[1], p[2], p[3])


@dataclass(frozen=True, slots=True)
class TokenBucketState:
    tokens: int  # millitokens
    ts: int  # epoch ms of the last write


def decide(state: TokenBucketState | None, params: TokenBucketParams, now_ms: int
           ) -> tuple[Decision, TokenBucketState | None]:
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
        return Decision(True, left, 0, tokens), TokenBucketState(left, max(ts, now_ms))
    return Decision(False, tokens, ceil_div((p.cost - tokens) * p.period_ms, p.refill)), None


def expiry_ms(params: TokenBucketParams, slack_ms: int) -> int:
    return params.full_ms + slack_ms
