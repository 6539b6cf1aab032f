"""Demand-weighted fair share of what is left: the one policy both services speak.

The allocator shares a low pool window among the regions asking for it
(``allocator.allocation.fair_share``), and the region agent shares the tokens it could take for an
Envoy bucket among the Envoys reporting that bucket (``region_agent.leasing.rlqs_funding``): the
same function, so "fair" means one thing. Pure: no I/O, no clock.

Low means ``remaining < chunk_max x parties``: every party could not get a full chunk. Then each
party's share is ``remaining x weight / total weight`` (weights are the parties' demands, 1 at
least), rounded down, and 1 at least while anything remains. Not low: no cap (``None``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


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


def split(remaining: int, chunk_max: int, needs: Mapping[Hashable, int], demands: Mapping[Hashable, int]
          ) -> dict[Hashable, int]:
    """Give ``remaining`` tokens to the parties of ``needs`` (party -> tokens it asks for, at most
    ``chunk_max`` each): every need in full when that fits, else each party its
    :func:`fair_share` (capped at its need), in order of demand; what rounding left over goes, one
    token at a time, to the parties still short. Never more than ``remaining`` in total."""
    out = {k: 0 for k in needs}
    left = max(0, remaining)
    if sum(needs.values()) <= left:
        return dict(needs)
    order = sorted(needs, key=lambda k: (-demands.get(k, 0), str(k)))
    for k in order:
        share = fair_share(remaining, chunk_max, {p: demands.get(p, 0) for p in needs}, k)
        give = min(needs[k], share if share is not None else needs[k], left)
        out[k], left = give, left - give
    while left > 0:
        short = [k for k in order if out[k] < needs[k]]
        if not short:
            break
        for k in short:
            if left <= 0:
                break
            out[k] += 1
            left -= 1
    return out


__all__ = ["fair_share", "is_low", "split"]
