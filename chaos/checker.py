"""Check a chaos run's history against the executable invariants.

``check(history, pools, tolerance_ms)`` runs every function of
:mod:`chaos.invariants` over the history's records and returns a :class:`Report`:
a verdict per invariant (with its violations), per pool and window the admitted total against
its bound (and the worst case), utilisation for windows whose demand exceeded G, and the
faults injected. ``Report.render()`` is the short text form.

Which records feed which check:

* granted <= G: etcd's own grant records (``etcd_grant``, net of tokens returned by usage
  reports), or — when the run read nothing back — the grants regions received; and etcd's
  own per-window records (``etcd_window``);
* no double grant: every sighting (``grant`` and ``etcd_grant``);
* no stale-epoch commit: ``etcd_grant`` (mod revisions) against ``leader`` records and every
  epoch seen; no stale-epoch accept: the regions' ``grant`` records in receipt order; both per
  shard of allocator leadership when the ``meta`` record says the run was sharded;
* spend within grant / no spend after expiry: lease spends of allowed ``decision`` records
  (plus ``spend_close`` totals for the former);
* admitted within bound and utilisation: ``decision`` records, with the pools in force from the
  ``pools`` argument and any ``policy`` records, the ``topology`` record (agents per region,
  allocator clock offsets) and the ``fault`` records' effects (who could not reach the allocator
  or Redis, in which windows): :func:`kernel.bound.pool_bound` per window. A decision is placed
  in the allocator-clock windows between its send and its answer; when that is more than one,
  any attribution that fits every window's bound is accepted (see
  :func:`chaos.invariants.admitted_within_bound`) and the note counts such decisions. Decisions
  an Envoy took itself from RLQS quota assignments (``gateway`` set: read from its access log,
  :mod:`chaos.rlqs`) count like any other, and the ``rlqs`` record adds the bound's RLQS term
  (:func:`kernel.bound.rlqs_term`; the Envoys a fault cut off from their agent: ``envoysCutOff``);
* acknowledged grants persisted: non-zero region-received grants against ``etcd_grant``. Only
  judged when the history holds etcd records (otherwise reported as not checked);
* fault-free utilisation: per pool and window, admitted / G against the demand offered to the pool
  (decisions admitted or denied by the pool's own rule: :class:`chaos.invariants.Utilisation`).
  A window whose demand exceeded G must reach :data:`chaos.invariants.UTILISATION_FLOOR` unless
  something touched it — a fault (from its start to its stop plus its grace, at least
  :data:`UTILISATION_GRACE_MS`), a failure no fault names (a leader change, a fallback decision),
  a policy change, or the edge of the run's load (a window the load did not cover from start to
  end): those are reported, marked, and not judged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import msgspec
from msgspec import Struct

from chaos import invariants as inv
from chaos.invariants import (
    DEFAULT_TOLERANCE_MS,
    PoolPolicy,
    Utilisation,
    Violation,
    WindowBound,
)
from kernel.bound import Faults, RlqsShape, Topology
from kernel.bundle import Bundle, Pool
from kernel.shards import shard_of

from .history import (
    DecisionRec,
    EtcdGrant,
    EtcdWindow,
    Fault,
    Grant,
    Leader,
    Meta,
    Record,
    RlqsRec,
    SpendClose,
    TopologyRec,
    close_to_spend,
    policies_from,
    read_history,
    to_grant_sighting,
    to_leader_term,
    to_pool_admissions,
    to_spend_records,
    to_window_state,
)

INVARIANTS = (
    "granted_within_limit",
    "window_states_within_limit",
    "no_double_grant",
    "no_stale_epoch_commit",
    "no_stale_epoch_accept",
    "lease_spend_within_grant",
    "no_spend_after_expiry",
    "admitted_within_bound",
    "acknowledged_grants_persisted",
    "fault_free_utilisation",
)

#: After a fault stops, its effect on utilisation may last this long at least (an agent's breaker
#: half-opens, a healed allocator link serves its next top-up, a new leader's first grants): the
#: windows until then are reported, not judged.
UTILISATION_GRACE_MS = 3_000


class Verdict(Struct):
    invariant: str
    ok: bool
    checked: bool  # False: the history had nothing to judge it on
    violations: list[Violation]
    note: str = ""


class Report(Struct):
    verdicts: list[Verdict]
    windows: list[WindowBound]
    worst: dict[str, WindowBound]  # per pool: the window with the largest admitted - bound
    utilisation: list[Utilisation]  # windows whose demand exceeded G (``touched`` ones are not judged)
    faults: list[Fault]
    tolerance_ms: int
    counts: dict[str, int]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def verdict(self, name: str) -> Verdict:
        for v in self.verdicts:
            if v.invariant == name:
                return v
        raise KeyError(name)

    def render(self, max_violations: int = 5) -> str:
        lines = [f"verdict: {'PASS' if self.ok else 'FAIL'}  (timing tolerance {self.tolerance_ms} ms; "
                 + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) + ")"]
        for v in self.verdicts:
            state = "ok  " if v.ok else "FAIL"
            if not v.checked:
                state = "n/a "
            lines.append(f"  [{state}] {v.invariant}" + (f" — {len(v.violations)} violation(s)" if v.violations else "")
                         + (f" ({v.note})" if v.note else ""))
            for viol in v.violations[:max_violations]:
                lines.append(f"         {viol.detail}")
            if len(v.violations) > max_violations:
                lines.append(f"         ... {len(v.violations) - max_violations} more")
        for pool, w in sorted(self.worst.items()):
            pct = 100.0 * w.overshoot / w.limit if w.limit else 0.0
            lines.append(f"  worst window of {pool}: #{w.window_index} admitted {w.admitted} vs G {w.limit} "
                         f"(overshoot {w.overshoot:+d}, {pct:+.1f}%), bound {w.bound} "
                         f"(fallback {w.fallback_allowance}, local {w.local_allowance}"
                         + (f", RLQS {w.rlqs_allowance}" if w.rlqs_allowance else "") + ")")
        lines += render_utilisation(self.utilisation)
        for f in self.faults:
            stop = "active" if f.stop_ms is None else f"{f.stop_ms}"
            lines.append(f"  fault {f.nemesis} on {f.target}: {f.start_ms} -> {stop} {f.detail}".rstrip())
        return "\n".join(lines)


def render_utilisation(util: Iterable[Utilisation]) -> list[str]:
    """Per pool, admitted / G of every window whose demand exceeded G, in window order (as the bound
    check attributed them); a window something touched (reported, not judged) is marked ``*``. The
    lowest judged value is given as attributed and *at most* (counting in each window the answers
    that may lie in a neighbouring one: what the check judges)."""
    by_pool: dict[str, list[Utilisation]] = defaultdict(list)
    for u in util:
        by_pool[u.pool].append(u)
    lines = []
    for pool, us in sorted(by_pool.items()):
        judged = [u for u in us if u.judged]
        low = "none judged" if not judged else (
            f"lowest judged {min(u.ratio for u in judged):.2f} as attributed, "
            f"{min(u.ratio_max for u in judged):.2f} at most")
        lines.append(f"  utilisation of {pool} (windows with demand > G; * touched, not judged; {low}): "
                     + " ".join(f"{u.ratio:.2f}{'*' if u.touched else ''}"
                                for u in sorted(us, key=lambda u: u.window_index)))
    return lines


def failure_spans(leaders: Iterable[Leader], decisions: Iterable[DecisionRec]) -> list[tuple[int, int, str]]:
    """Failures no fault record names, on the recorder clock: a leader change (a new epoch of a
    shard, :data:`UTILISATION_GRACE_MS` either side of when it was observed), and a decision from a
    fallback or local allowance (the allocator or Redis could not be reached: from its send to its
    answer plus the grace). E.g. etcd taking seconds to settle after an isolated member rejoins
    outlasts the fault's recorded grace; the bound check judges those windows regardless."""
    out: list[tuple[int, int, str]] = []
    seen: dict[int, int] = {}
    for r in sorted(leaders, key=lambda r: r.observed_at_ms):
        if r.shard in seen and seen[r.shard] != r.epoch:
            out.append((r.observed_at_ms - UTILISATION_GRACE_MS, r.observed_at_ms + UTILISATION_GRACE_MS,
                        f"leader change (epoch {r.epoch})"))
        seen[r.shard] = r.epoch
    for d in decisions:
        if d.fallback or d.local:
            sent = d.sent_at_ms if d.sent_at_ms is not None else d.recorded_at_ms
            out.append((sent, d.recorded_at_ms + UTILISATION_GRACE_MS, "a fallback decision"))
    return out


def touched_windows(faults: Iterable[Fault], window_ms: dict[str, int], offsets_ms: tuple[int, int],
                    load_ms: tuple[int, int], end_ms: int,
                    failures: Iterable[tuple[int, int, str]] = ()):
    """``(pool, index) -> str``: what touched that allocator-clock window for the utilisation
    check — a fault (start to stop plus max(grace, :data:`UTILISATION_GRACE_MS`); to the end of the
    history while still active), a failure no fault names (``failures``: :func:`failure_spans`), or
    the edge of the load (``load_ms``: the first send and the last answer, recorder clock); empty
    when nothing did."""
    spans = [(f.start_ms + offsets_ms[0], (f.stop_ms if f.stop_ms is not None else end_ms)
              + max(f.grace_ms, UTILISATION_GRACE_MS) + offsets_ms[1], f"{f.nemesis} on {f.target}") for f in faults]
    spans += [(start + offsets_ms[0], stop + offsets_ms[1], name) for start, stop, name in failures]
    first, last = load_ms[0] + offsets_ms[1], load_ms[1] + offsets_ms[0]

    def of(pool: str, index: int) -> str:
        w = window_ms.get(pool)
        if not w:
            return ""
        lo, hi = index * w, (index + 1) * w
        if lo < first or hi > last:
            return "edge of the load"
        return next((name for start, stop, name in spans if start < hi and stop >= lo), "")

    return of


def allocator_offsets(topo: TopologyRec | None) -> tuple[int, int]:
    """(least, greatest) allocator clock - recorder clock over the run's allocator replicas."""
    offs = list(topo.allocator_offsets_ms.values()) if topo is not None else []
    return (min(offs), max(offs)) if offs else (0, 0)


def faults_by_window(faults: Iterable[Fault], topo: TopologyRec | None, window_ms: dict[str, int],
                     offsets_ms: tuple[int, int], end_ms: int, rlqs: RlqsRec | None = None):
    """``(pool, index) -> kernel.bound.Faults``: what the recorded faults made unreachable at some
    moment of that allocator-clock window. A fault's effect runs from its start to its stop plus
    its grace (to the end of the history while still active); an agent restarted during a window
    counts once more there (a new process, fresh in-process allowances); an Envoy cut off from its
    agent (``rlqs`` names its region) counts once per window."""
    region_of = {a: r for r, names in (topo.agents if topo else {}).items() for a in names}
    envoy_region = {e: r for r, names in (rlqs.envoys if rlqs else {}).items() for e in names}
    spans: list[tuple[int, int, list[str], list[str], list[str]]] = []
    restarts: list[tuple[int, str]] = []
    for f in faults:
        stop = f.stop_ms if f.stop_ms is not None else end_ms
        if f.allocator_regions or f.redis_agents or f.envoys_cut_off:
            spans.append((f.start_ms + offsets_ms[0], stop + f.grace_ms + offsets_ms[1], f.allocator_regions,
                          f.redis_agents, f.envoys_cut_off))
        if f.stop_ms is not None:
            restarts += [(f.stop_ms, a) for a in f.restarted_agents]

    def of(pool: str, index: int) -> Faults:
        w = window_ms.get(pool)
        if not w:
            return Faults()
        lo, hi = index * w, (index + 1) * w
        cut: set[str] = set()
        redis: set[str] = set()
        envoys: set[str] = set()
        for start, stop, regions, agents, gateways in spans:
            if start < hi and stop >= lo:
                cut.update(regions)
                redis.update(agents)
                envoys.update(gateways)
        procs: dict[str, int] = defaultdict(int)
        for a in redis:
            again = sum(1 for at, b in restarts if b == a and at + offsets_ms[0] < hi and at + offsets_ms[1] >= lo)
            procs[region_of.get(a, a)] += 1 + again
        off: dict[str, int] = defaultdict(int)
        for e in envoys:
            off[envoy_region.get(e, e)] += 1
        return Faults(frozenset(cut), dict(procs), dict(off))

    return of


def rlqs_shapes(rec: RlqsRec | None) -> dict[str, RlqsShape]:
    """Per pool, the Envoys of the run that hold quota assignments of it (the bound's RLQS term)."""
    if rec is None:
        return {}
    envoys = {r: len(names) for r, names in rec.envoys.items() if names}
    return {pool: RlqsShape(envoys=envoys, buckets=n, max_assignment=rec.max_assignment, fallback=rec.fallback,
                            margin_ms=rec.margin_ms) for pool, n in rec.buckets.items()}


def _pool_policies(pools: Bundle | Iterable[Pool | PoolPolicy]) -> list[PoolPolicy]:
    if isinstance(pools, Bundle):
        return PoolPolicy.from_bundle(pools)
    return [p if isinstance(p, PoolPolicy) else PoolPolicy.from_pool(p) for p in pools]


def check(history: str | Path | Iterable[Record], pools: Bundle | Iterable[Pool | PoolPolicy] = (),
          tolerance_ms: int = DEFAULT_TOLERANCE_MS) -> Report:
    """Run every invariant over a history file (path) or records. ``pools`` is the policy in
    force at the start (a Bundle — its rules give each pool's balances and allowances — or
    bundle Pools or PoolPolicy); ``policy`` records in the history add the versions applied
    mid-run."""
    records: list[Record] = list(read_history(history) if isinstance(history, str | Path) else history)
    policies = _pool_policies(pools) + policies_from(records)

    grants = [r for r in records if isinstance(r, Grant)]
    etcd = [r for r in records if isinstance(r, EtcdGrant)]
    etcd_windows = [to_window_state(r) for r in records if isinstance(r, EtcdWindow)]
    decisions = [r for r in records if isinstance(r, DecisionRec)]
    closes = [r for r in records if isinstance(r, SpendClose)]
    leaders = [r for r in records if isinstance(r, Leader)]
    faults = [r for r in records if isinstance(r, Fault)]
    shards = max([r.shards for r in records if isinstance(r, Meta)], default=1)
    shard_fn = (lambda pool: shard_of(pool, shards)) if shards > 1 else None
    topo = next((r for r in records if isinstance(r, TopologyRec)), None)
    rlqs = next((r for r in records if isinstance(r, RlqsRec)), None)
    offsets = allocator_offsets(topo)
    window_ms = {p.id: p.window_ms for p in policies}

    received = [to_grant_sighting(g) for g in grants]
    stored = [to_grant_sighting(g) for g in etcd]
    window_of = {g.lease_id: g.window_index for g in received + stored}
    d_recs = [d for dec in decisions for d in to_pool_admissions(dec, window_of, window_ms, offsets)]
    end_ms = max([d.recorded_at_ms for d in decisions] + [f.stop_ms or f.start_ms for f in faults] + [0])
    topology = (Topology(agents={r: len(a) for r, a in topo.agents.items() if a}) if topo is not None
                else inv.topology_of(d_recs))
    timed_spends = [s for dec in decisions for s in to_spend_records(dec)]
    all_grants = received + stored

    verdicts: list[Verdict] = []

    def add(name: str, violations: list[Violation], checked: bool = True, note: str = "") -> None:
        verdicts.append(Verdict(name, not violations, checked, violations, note))

    add("granted_within_limit", inv.granted_within_limit(stored or [g for g in received if g.accepted], policies),
        checked=bool(stored or received), note="" if stored else "from region receipts: no etcd records")
    add("window_states_within_limit", inv.window_states_within_limit(etcd_windows, policies),
        checked=bool(etcd_windows), note="" if etcd_windows else "no etcd window records read back")
    add("no_double_grant", inv.no_double_grant(all_grants), checked=bool(all_grants))
    add("no_stale_epoch_commit", inv.no_stale_epoch_commit(stored, [to_leader_term(x) for x in leaders], shard_fn),
        checked=bool(stored), note="" if stored else "needs etcd records with revisions")
    add("no_stale_epoch_accept", inv.no_stale_epoch_accept(received, shard_fn), checked=bool(received))
    spend_viol = inv.lease_spend_within_grant(timed_spends, all_grants)
    close_viol = [Violation(v.invariant, "closing report: " + v.detail, v.pool, v.window_index, v.lease_id,
                            v.observed, v.bound)
                  for v in inv.lease_spend_within_grant([close_to_spend(c) for c in closes], all_grants)]
    add("lease_spend_within_grant", spend_viol + close_viol, checked=bool(timed_spends or closes))
    # window ends are on the allocator's clock: on the recorder's, the latest moment they may mean
    on_recorder = [g if g.window_end_ms is None else msgspec.structs.replace(g, window_end_ms=g.window_end_ms - offsets[0])
                   for g in all_grants]
    add("no_spend_after_expiry", inv.no_spend_after_expiry(timed_spends, on_recorder, tolerance_ms),
        checked=bool(timed_spends))
    bound = inv.admitted_within_bound(d_recs, policies, faults_by_window(faults, topo, window_ms, offsets, end_ms, rlqs),
                                      topology, rlqs_shapes(rlqs))
    straddling = sum(1 for d in d_recs if d.allowed and d.last_window is not None)
    add("admitted_within_bound", bound.violations, checked=bool(d_recs),
        note=f"{straddling} admission(s) between two windows, attributed to fit where possible" if straddling
        else "")
    add("acknowledged_grants_persisted", inv.acknowledged_grants_persisted(received, stored),
        checked=bool(stored), note="" if stored else "no etcd records read back")

    worst: dict[str, WindowBound] = {}
    for w in bound.windows:
        cur = worst.get(w.pool)
        if cur is None or (w.excess, w.overshoot) > (cur.excess, cur.overshoot):
            worst[w.pool] = w
    load_ms = (min((d.sent_at_ms if d.sent_at_ms is not None else d.recorded_at_ms for d in decisions), default=0),
               max((d.recorded_at_ms for d in decisions), default=0))
    touched = touched_windows(faults, window_ms, offsets, load_ms, end_ms, failure_spans(leaders, decisions))
    util = [u for u in inv.utilisation(d_recs, policies, bound.windows, touched) if u.demand > u.limit]
    judged = [u for u in util if u.judged]
    add("fault_free_utilisation", inv.fault_free_utilisation(util), checked=bool(judged),
        note=f"{len(judged)} window(s) judged, {len(util) - len(judged)} touched" if util else "")
    counts = {"grants": len(grants), "etcd_grants": len(etcd), "etcd_windows": len(etcd_windows), "decisions": len(decisions),
              "faults": len(faults), "leaders": len(leaders)}
    if rlqs is not None:
        counts["envoy_decisions"] = sum(1 for d in decisions if d.gateway is not None)
    return Report(verdicts, bound.windows, worst, util, faults, tolerance_ms, counts)
