"""``python -m chaos fallbacks --history RUN.jsonl`` — the admissions not paid by a lease that no
recorded fault explains (outside every fault's effect, grace included), each with the agent's
degradation and shedding counters that moved around it (``counters`` records, sampled every
2 s): which path of the agent spent a fallback allowance while nothing was unreachable.
Pure apart from reading the history."""

from __future__ import annotations

from collections.abc import Iterable

from .history import Counters, DecisionRec, Fault, Meta, Record


def unexplained(records: Iterable[Record], around_ms: int = 2_500) -> list[str]:
    recs = list(records)
    t0 = next((r.started_at_ms for r in recs if isinstance(r, Meta)), 0)
    spans = [(f.start_ms, (f.stop_ms if f.stop_ms is not None else 1 << 62) + f.grace_ms, set(f.allocator_regions),
              set(f.redis_agents)) for f in recs if isinstance(f, Fault)]
    samples: dict[str, list[Counters]] = {}
    for r in recs:
        if isinstance(r, Counters):
            samples.setdefault(r.service, []).append(r)
    out = []
    for d in recs:
        if not (isinstance(d, DecisionRec) and d.allowed and (d.fallback or d.local)):
            continue
        t = d.recorded_at_ms
        if any(a <= t <= b and (d.region in regions or d.agent in agents) for a, b, regions, agents in spans):
            continue
        moved = []
        series = samples.get(d.agent, [])
        before = [s for s in series if s.at_ms <= t - around_ms]
        after = [s for s in series if s.at_ms >= t]
        if after:
            base = before[-1].values if before else {}
            later = next((s for s in after if s.at_ms <= t + around_ms), after[0]).values
            moved = [f"{k.split('{', 1)[1].rstrip('}')} +{later[k] - base.get(k, 0.0):g}" for k in sorted(later)
                     if later[k] > base.get(k, 0.0)]
        pools = ",".join(s.pool for s in d.spends) or "-"
        sent = f", {t - d.sent_at_ms} ms" if d.sent_at_ms is not None else ""
        out.append(f"{(t - t0) / 1000:7.2f} s {d.agent} {d.tenant}/{d.route_group} pools {pools}: "
                   f"{d.rule_id} limit {d.limit}{sent}; agent counters moved: {'; '.join(moved) or 'none seen'}")
    return out
