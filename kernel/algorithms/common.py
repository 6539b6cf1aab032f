"""Shared pieces of the reference models: a rule's verdict, integer validation, ceil division,
and the registry of call kinds (what ``lua/multi_rule.lua`` dispatches on).

The models mirror ``lua/lib/*.lua`` exactly (same integer arithmetic, same validation), so they
serve as the test oracle for the scripts and as the agent's in-process fallback limiters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
class RuleVerdict:
    """One rule's answer to one request (a model's ``decide``; the scripts' per-rule plan)."""

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


NEVER = RuleVerdict(False, 0, -1)


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


# --- call kinds ------------------------------------------------------------------------------
Step = Callable[[Any, Any, int, str, str], tuple[RuleVerdict, Any]]  # (state, params, now, member, incarnation)


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of rule slot in a ``multi_rule.lua`` call: its ARGV code, the Lua library that
    implements it, and its reference model. Each model module registers its kind once
    (:func:`register_kind`); the script loader generates ``multi_rule.lua``'s dispatch table from
    :data:`KINDS` and the multi-rule model dispatches on it."""

    code: str  # ARGV kind ("tb", "sl", ...)
    lua_table: str  # the table the library defines ("TB", "SL", ...)
    lib: str  # the library, relative to lua/ ("lib/sliding_log.lua")
    parse: Callable[[tuple[int, ...]], Any]  # the five ARGV parameters -> model parameters (raises InvalidArguments)
    step: Step
    needs_member: bool = False  # the slot stores the decision id (refused without one)
    records_denial: bool = True  # False: a denial by this slot is not stored in the decision record


KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    if kind.code in KINDS:
        raise ValueError(f"call kind {kind.code!r} registered twice")
    KINDS[kind.code] = kind
    return kind
