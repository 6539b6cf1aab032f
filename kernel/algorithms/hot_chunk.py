"""A hot key set's chunk: up to ``want`` units of one request's rules taken at once; mirrors
``lua/hot_chunk.lua`` (its header is the contract) and is its test oracle.

A request of ``k`` units is the request's slots with each cost parameter times ``k``; the chunk is
the largest ``k`` in [min, want] that :func:`kernel.algorithms.multi_rule.decide` admits, charged
exactly as that one request would be. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .common import InvalidArguments, check_int
from .multi_rule import MAX_RULES, RuleSpec, decide, parse_rules

#: Per kind a chunk may take, the index (0-based) of the cost parameter among the five.
COST_PARAM: dict[str, int] = {"tb": 3, "gcra": 3, "fw": 2, "sc": 2, "sl": 2, "pool": 0}


def scaled(rules: Sequence[RuleSpec], units: int) -> list[RuleSpec]:
    """The slots of a request of ``units`` units, from those of one unit."""
    out = []
    for r in rules:
        at = COST_PARAM[r.kind]
        p = list(r.params)
        p[at] = r.params[at] * units
        out.append(RuleSpec(r.kind, tuple(p)))  # type: ignore[arg-type]  # five parameters, as given
    return out


def _fits(rules: Sequence[RuleSpec], units: int, member: str) -> bool:
    try:
        parse_rules(scaled(rules, units), member)
    except InvalidArguments:
        return False
    return True


def check_call(rules: Sequence[RuleSpec], member: str, min_units: int, want: int) -> None:
    """The script's validation (raises :class:`InvalidArguments` where it answers its error reply)."""
    if not 1 <= len(rules) <= MAX_RULES or not member:
        raise InvalidArguments("1..8 rules and a member")
    check_int(min_units, 1, name="min")
    check_int(want, min_units, name="want")
    if any(r.kind not in COST_PARAM for r in rules):
        raise InvalidArguments("a chunk takes tb, gcra, fw, sc, sl and pool slots only")
    for r in rules:
        check_int(r.params[COST_PARAM[r.kind]], 1, name="cost")
    parse_rules(rules, member)
    if not _fits(rules, min_units, member):
        raise InvalidArguments("min units are beyond a rule's range")


def take(states: Sequence[Any], rules: Sequence[RuleSpec], now_ms: int, member: str, min_units: int, want: int,
         incarnation: str = "") -> tuple[list[int], list[Any] | None]:
    """(the script's reply without ``valid_for_ms``'s value checked here: see :func:`reply_of`,
    the new states or None when nothing was written). ``rules``: the slots of one unit."""
    check_call(rules, member, min_units, want)
    d, new = decide(states, scaled(rules, min_units), now_ms, member, incarnation)
    if not d.allowed:
        return [0, 0, *d.as_reply()], None
    best, taken = (d, new), min_units
    if want > min_units:
        top = decide(states, scaled(rules, want), now_ms, member, incarnation) if _fits(rules, want, member) else None
        if top is not None and top[0].allowed:
            best, taken = top, want
        else:
            lo, hi = min_units, want
            while hi - lo > 1:
                mid = (lo + hi) // 2
                got = decide(states, scaled(rules, mid), now_ms, member, incarnation) if _fits(rules, mid, member) \
                    else None
                if got is not None and got[0].allowed:
                    lo, best = mid, got
                else:
                    hi = mid
            taken = lo
    return [taken, VALID_UNCHECKED, *best[0].as_reply()], best[1]


#: ``valid_for_ms`` in a model reply: the model does not recompute window ends (compare with
#: :func:`reply_of`, which drops it from the script's reply).
VALID_UNCHECKED = -2


def reply_of(reply: Sequence[Any]) -> list[int]:
    """A script reply with ``valid_for_ms`` replaced by :data:`VALID_UNCHECKED` (when something
    was taken), for comparison with :func:`take`."""
    out = [int(x) for x in reply]
    if out and out[0] > 0:
        out[1] = VALID_UNCHECKED
    return out
