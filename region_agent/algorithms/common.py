"""Shared pieces of the reference models: the decision type, integer validation, ceil division.

The models mirror ``lua/lib/*.lua`` exactly (same integer arithmetic, same validation), so they
serve as the test oracle for the scripts and as the agent's in-process fallback limiters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kernel.errors import ScriptRejected

MAX_ARG = 2**40
MAX_PRODUCT = 2**52
MAX_TIME = 2**50


class InvalidArguments(ScriptRejected):
    """The arguments the script would refuse with 'ERR rate limit policy arguments invalid'."""

    code, title = "policy-arguments-invalid", "Rate limit policy arguments invalid"


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    remaining: int
    retry_after_ms: int  # 0 when allowed, -1 = can never succeed
    # allowed only: the value before this request's debit (reported by the multi-rule call
    # when another rule denies); None = same as remaining
    current: int | None = field(default=None, compare=False)

    @property
    def undebited(self) -> int:
        return self.remaining if self.current is None else self.current

    def as_reply(self) -> list[int]:
        return [int(self.allowed), self.remaining, self.retry_after_ms]


NEVER = Decision(False, 0, -1)


def check_int(x: Any, lo: int, hi: int = MAX_ARG, *, name: str = "argument") -> int:
    """``x`` as an int if it is a finite integer in [lo, hi]; else :class:`InvalidArguments`.
    Integral floats are accepted (the script's tonumber accepts "20.0"); bools and strings are not."""
    if isinstance(x, bool):
        raise InvalidArguments(f"{name} must be an integer")
    if isinstance(x, float):
        if not math.isfinite(x) or not x.is_integer():
            raise InvalidArguments(f"{name} must be a finite integer")
        x = int(x)
    if not isinstance(x, int):
        raise InvalidArguments(f"{name} must be an integer")
    if not lo <= x <= hi:
        raise InvalidArguments(f"{name} must be in [{lo}, {hi}]")
    return x


def check_product(a: int, b: int, what: str) -> None:
    if a * b > MAX_PRODUCT:
        raise InvalidArguments(f"{what} must be at most 2^52")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
