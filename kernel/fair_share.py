"""Demand-weighted fair share of what is left: the one policy both services speak.

The allocator shares a low pool window among the regions asking for it
(``allocator.allocation.fair_share``: :func:`fair_share`), and the region agent shares the tokens
one funding round took for an Envoy bucket among the Envoys waiting for them
(``region_agent.leasing.rlqs_funding``: :func:`split`): both by demand, so "fair" means one thing.
The allocator's shares are whole tokens rounded down (a region asks again); a round's tokens are
all given at once, so :func:`split` carries each party's rounding to its next round instead.
Pure: no I/O, no clock.

Low means ``remaining < chunk_max x parties``: every party could not get a full chunk. Then each
party's share is ``remaining x weight / total weight`` (weights are the parties' demands, 1 at
least), rounded down, and 1 at least while anything remains. Not low: no cap (``None``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def is_low(remaining: int, chunk_max: int, parties: int) -> bool:
    """Could some party not get a full chunk out of ``remaining``?"""
    return remaining < chunk_max * max(1, parties)


def fair_share(remaining: int, chunk_max: int, demands: Mapping[Hashable, int], who: Hashable) -> int | None:
    """``who``'s share of ``remaining`` among the parties of ``demands`` (party -> demand), or
    None when what remains is not low (module doc). A party missing from ``demands`` weighs 1."""
    if not is_low(remaining, chunk_max, len(demands)):
        return None
    if remaining <= 0:
        return 0
    weights = {k: max(1, d) for k, d in demands.items()}
    total = sum(weights.values())
    return max(1, remaining * weights.get(who, 1) // max(1, total))


def split(tokens: int, needs: Mapping[K, int], weights: Mapping[K, float],
          owed: Mapping[K, float] | None = None) -> tuple[dict[K, int], dict[K, float]]:
    """Share ``tokens`` among the parties of ``needs`` (party -> tokens it asks for) by
    ``weights`` (their demands): every need in full when that fits; else each party's exact share,
    ``tokens x weight / total weight`` of the parties not yet given their need (a share above a
    need goes to the others the same way). Whole tokens: each exact share plus what earlier splits
    ``owed`` the party, rounded down, then what is left one token at a time to the largest
    remainders.

    Returns the whole tokens and what each party is owed after: its exact share plus what it was
    owed less what it got, a fraction of a token either way (0 for a party given its need). The
    caller carries it to the next split among the same parties, so over a run of small splits (a
    token or two each) rounding favours nobody: rounded alone, every such split went to the
    heaviest party. Never more than ``tokens`` in total, nor more than a need; nothing left idle
    while a party is short."""
    owed = owed or {}
    if sum(needs.values()) <= tokens:
        return dict(needs), {k: 0.0 for k in needs}
    exact = {k: 0.0 for k in needs}
    short = {k for k in needs if needs[k] > 0}
    left = float(max(0, tokens))
    while short and left > 0:  # water-filling: at most one pass per party
        total = sum(_weight(weights, k) for k in short)
        full = {k for k in short if left * _weight(weights, k) / total >= needs[k]}
        if not full:
            for k in short:
                exact[k] = left * _weight(weights, k) / total
            break
        for k in full:
            exact[k] = float(needs[k])
            left -= needs[k]
        short -= full
    target = {k: exact[k] + (owed.get(k, 0.0) if exact[k] < needs[k] else 0.0) for k in needs}
    gives = {k: max(0, min(needs[k], math.floor(target[k]))) for k in needs}
    rest = max(0, tokens) - sum(gives.values())
    # largest remainder first; a tie to the heavier party
    by_remainder = sorted(needs, key=lambda k: (gives[k] - target[k], -_weight(weights, k), str(k)))
    while rest > 0 and any(gives[k] < needs[k] for k in needs):
        for k in by_remainder:
            if rest > 0 and gives[k] < needs[k]:
                gives[k] += 1
                rest -= 1
    while rest < 0 and any(gives.values()):  # what earlier splits owed came to more than there is
        for k in reversed(by_remainder):
            if rest < 0 and gives[k] > 0:
                gives[k] -= 1
                rest += 1
    after = {k: 0.0 if gives[k] >= needs[k] else max(-1.0, min(1.0, target[k] - gives[k])) for k in needs}
    return gives, after


def _weight(weights: Mapping[K, float], k: K) -> float:
    return max(1e-9, float(weights.get(k, 0.0)))


__all__ = ["fair_share", "is_low", "split"]
