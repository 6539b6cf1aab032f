"""What a plan shape's rules say about serving its key set from chunks (``hotChunk``): derived
once, when the snapshot makes the shape (region_agent.decision.plan.Snapshot.shape), and read on
every attempt by region_agent.leasing.hot_chunks.

A key set can be chunked only when every slot's rule carries ``hotChunk`` and none is a
concurrency gate, and every slot's kind is one ``lua/hot_chunk.lua`` takes: a chunk is charged to
every rule of the request at once, so one rule that cannot be charged that way rules the key set
out."""

from __future__ import annotations

from typing import Any, NamedTuple

from kernel.algorithms import Role
from kernel.algorithms.hot_chunk import COST_PARAM
from kernel.errors import ScriptRejected

from .call import Call, multi_rule_argv


class HotConfig(NamedTuple):
    """What a plan shape's rules say about chunking its key sets (derived once per shape)."""

    threshold_per_s: int  # the largest of the rules' thresholds: every rule must find the key set hot
    validity_ms: int  # the shortest of the rules' validities
    chunk_max: tuple[int, ...]  # per slot: its rule's chunkMax (units one process may hold of its key)
    unit_argv: tuple[Any, ...]  # hot_chunk.lua's ARGV per slot for ONE unit (kind and five parameters each)
    unit_cost: tuple[int, ...]  # per slot: its cost parameter for one unit (the script's units)


def derive_hot(shape: Any) -> HotConfig | None:
    """The chunking of ``shape``'s key sets (a region_agent.decision.plan.Shape), or None when its
    rules rule it out (module doc)."""
    slots = shape.slots
    if not slots or any(s.role is Role.CC or s.rule.hot_chunk is None for s in slots):
        return None
    specs, _, _ = shape.params_for(1)
    if any(kind not in COST_PARAM for kind, _ in specs):
        return None
    try:
        _, argv = multi_rule_argv("-", [Call(f"k{i}", k, p) for i, (k, p) in enumerate(specs)],
                                  slack_ms=0, decision_ttl_ms=0, member="-")
    except ScriptRejected:
        return None
    cfgs = [s.rule.hot_chunk for s in slots]
    return HotConfig(threshold_per_s=max(c.threshold_per_s for c in cfgs),
                     validity_ms=min(c.validity_ms for c in cfgs),
                     chunk_max=tuple(c.chunk_max for c in cfgs), unit_argv=tuple(argv[3:-1]),
                     unit_cost=tuple(p[COST_PARAM[k]] for k, p in specs))
