"""Render the overshoot bound of a bundle (:mod:`kernel.bound`) for people: the per-pool terms
``leasehold policy validate FILE --bound`` prints, and the Markdown tables the READMEs carry
(``python -m devtools.doc_tables`` keeps them in step with the function)."""

from __future__ import annotations

from collections.abc import Sequence

from kernel.bound import (
    Faults,
    PoolBound,
    Topology,
    approximate_bounds,
    hot_chunk_terms,
    pool_bound,
    pool_shapes,
    split_bounds,
)
from kernel.bundle import Bundle


def _n(x: int | None) -> str:
    return "unbounded" if x is None else f"{x:,}"


def _window(ms: int) -> str:
    return f"{ms // 1000} s" if ms % 1000 == 0 else f"{ms} ms"


def cases(topology: Topology) -> list[tuple[str, Faults]]:
    return [("healthy", Faults()), ("allocator unreachable in every region", Faults.allocator_only(topology)),
            ("and Redis unreachable for every agent", Faults.worst(topology))]


def text_report(bundle: Bundle, topology: Topology) -> str:
    regions, agents = len(topology.agents), sorted(set(topology.agents.values()))
    lines = [f"overshoot bound per pool window (kernel.bound), {regions} region(s) x "
             f"{'/'.join(map(str, agents))} agent(s) per region:"]
    for shape in pool_shapes(bundle):
        worst = pool_bound(shape, topology, Faults.worst(topology))
        kind = "global-scope pool (in-process chunks)" if shape.global_scope else "tenant pool"
        lines.append(f"pool {shape.id}: {kind}, G {shape.limit:,} per {_window(shape.window_ms)}, "
                     f"fallbackPerRegion {shape.fallback_per_region:,}, "
                     f"{'?' if shape.balances is None else shape.balances} balance(s) per region")
        for t in worst.terms:
            lines.append(f"  {t.name:<18} {_n(t.tokens):>12}   {t.formula}")
        lines.append(f"  {'total':<18} {_n(worst.total):>12}   "
                     + ", ".join(f"{name}: {_n(pool_bound(shape, topology, f).total)}"
                                 for name, f in cases(topology)[:2]))
    hot = hot_chunk_terms(bundle, topology)
    if hot:
        lines.append("hot-key chunks: beyond a rule's limit, per key and window of the rule, in a region with "
                     f"{max(topology.agents.values())} agent process(es) (kernel.bound.hot_chunk_term):")
        for rule, t in hot:
            lines.append(f"  rule {rule.id} ({rule.algorithm}): {_n(t.tokens)}   {t.formula}")
    lines.extend(rule_lines(bundle, topology))
    return "\n".join(lines)


def rule_lines(bundle: Bundle, topology: Topology) -> list[str]:
    """The bounds of approximate rules (per key and window, with every agent process of the
    largest region counting the key) and the slack of split tenants."""
    lines: list[str] = []
    agents = max(topology.agents.values())
    approx = approximate_bounds(bundle, agents)
    if approx:
        lines.append(f"approximate rules, per key and window, {agents} agent process(es) counting a key "
                     "(kernel.approx):")
        lines += [f"  {b.rule:<18} {b.total:>12,}   {b.formula}" for b in approx]
    splits = split_bounds(bundle)
    if splits:
        lines.append("split tenants (kernel.split; no overshoot term: the shares add up to the limit):")
        lines += [f"  {s.formula}" for s in splits]
    return lines


def markdown_table(bundle: Bundle, regions: Sequence[str], agents_per_region: Sequence[int] = (1, 2)) -> str:
    """Per pool: G, F, and the bound healthy / with every region cut off from the allocator /
    with every agent also cut off from Redis, for each number of agents per region."""
    one = Topology.uniform(regions, 1)
    head = ["pool", "scope", "G per window", "F per region", "healthy", "allocator unreachable (all regions)"]
    head += [f"+ Redis unreachable, {n} agent{'s' if n > 1 else ''}/region" for n in agents_per_region]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in pool_shapes(bundle):
        def cell(b: PoolBound) -> str:
            if b.total is None:
                return "unbounded"
            return f"{b.limit:,} + {b.total - b.limit:,} = **{b.total:,}**" if b.total != b.limit else f"{b.total:,}"

        row = [f"`{shape.id}`", "global (chunks)" if shape.global_scope else "tenant",
               f"{shape.limit:,} / {_window(shape.window_ms)}", f"{shape.fallback_per_region:,}",
               cell(pool_bound(shape, one)), cell(pool_bound(shape, one, Faults.allocator_only(one)))]
        for n in agents_per_region:
            topo = Topology.uniform(regions, n)
            row.append(cell(pool_bound(shape, topo, Faults.worst(topo))))
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)
