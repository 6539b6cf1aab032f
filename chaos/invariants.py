"""Executable invariants (docs/invariants.md I8, I16-I19).

Pure functions over plain records: no I/O, no clock. Each check returns a list of
:class:`Violation` (empty = the invariant held), so the allocator's own tests, unit tests
and the chaos checker (``chaos/checker.py``) all run the same code.

Clocks. Every timestamp says which clock it is on:

* ``*_at_ms`` fields named *allocator* (``expires_at_ms``, ``issued_at_ms``) are on the
  allocator leader's wall clock (the wire type :class:`kernel.wire.LeaseGrant`).
* ``sent_at_ms`` / ``received_at_ms`` of a grant and ``at_ms`` of a spend or decision are on
  the *recorder's* clock: the wall clock of the process that writes the history (the chaos
  runner / load generator), never a service that may run under ``faketime``.
* Revisions (``commit_revision``, ``elected_revision``) are etcd revisions: one total order
  for everything etcd committed, independent of any clock.

Windows: ``index = floor(t_ms / windowMs)`` on the allocator clock; a record carries the
window index it was granted or admitted for, so no check re-derives it from a skewed clock.

Epochs belong to a shard of allocator leadership (one shard, every pool, unless the allocator
is sharded): the epoch checks take ``shard_of`` (pool -> shard) and compare epochs only within
a shard; without it every pool is in one shard, as in an unsharded deployment.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from msgspec import Struct

from kernel.bound import RLQS, Faults, PoolBound, PoolShape, RlqsShape, Topology, pool_bound, shape_of
from kernel.bundle import Bundle, Pool, Rule

#: Default slack for timing checks, on the recorder's clock. It absorbs the time between the
#: agent's admission and the recorder writing it down (one loopback HTTP round trip plus
#: scheduling on a loaded 2-core machine) — not clock skew of the services, which the
#: design itself must absorb (leases are timed from the region's send time).
DEFAULT_TOLERANCE_MS = 250


# ----------------------------------------------------------------------------- records
class PoolPolicy(Struct, frozen=True):
    """A pool's limit as in force from ``valid_from_ms`` (recorder clock; None = from the start).

    Several entries with the same ``id`` describe policy changes (e.g. a rollback published as
    a new version mid-run); a window's bound takes the most generous version in force at any
    moment of that window, so a mid-window change is never reported as a violation by itself.
    ``window_ms`` must not change between versions of one pool. The remaining fields are the
    pool's shape for :func:`kernel.bound.pool_bound` (how many balances and in-process
    allowances the bundle's rules give it); :meth:`from_bundle` fills them in."""

    id: str
    limit: int  # G: tokens per window
    window_ms: int
    fallback_per_region: int = 0
    valid_from_ms: int | None = None
    chunk_max: int = 1
    global_scope: bool = False
    balances: int | None = 1  # regional balances per region (None: unbounded)
    local_keys: int | None = 1  # in-process allowances per agent (None: unbounded)
    regions: list[str] | None = None  # regions that may lease it (None: any)
    hot_chunks: bool = False  # a rule spending it takes hot-key chunks (its term: kernel.bound)
    prefetch_ms: int = 0  # a window's record (and its G) may be made this long before it starts

    @classmethod
    def from_pool(cls, pool: Pool, valid_from_ms: int | None = None, rules: Iterable[Rule] | None = None
                  ) -> PoolPolicy:
        """From a bundle's :class:`~kernel.bundle.Pool` (``limit`` per ``windowMs``); with the
        bundle's ``rules`` the shape is exact, without them one balance and one allowance."""
        if rules is None:
            return cls(id=pool.id, limit=pool.limit, window_ms=pool.window_ms,
                       fallback_per_region=pool.fallback_per_region, valid_from_ms=valid_from_ms,
                       chunk_max=pool.chunk_max, regions=list(pool.regions) if pool.regions is not None else None,
                       prefetch_ms=pool.prefetch_ms)
        sh = shape_of(pool, rules)
        return cls(id=pool.id, limit=pool.limit, window_ms=pool.window_ms,
                   fallback_per_region=pool.fallback_per_region, valid_from_ms=valid_from_ms,
                   chunk_max=pool.chunk_max, global_scope=sh.global_scope, balances=sh.balances,
                   local_keys=sh.local_keys, regions=list(sh.regions) if sh.regions is not None else None,
                   hot_chunks=sh.hot_chunks, prefetch_ms=pool.prefetch_ms)

    @classmethod
    def from_bundle(cls, bundle: Bundle, valid_from_ms: int | None = None) -> list[PoolPolicy]:
        return [cls.from_pool(p, valid_from_ms, bundle.rules) for p in bundle.pools]

    def shape(self) -> PoolShape:
        return PoolShape(id=self.id, limit=self.limit, window_ms=self.window_ms,
                         fallback_per_region=self.fallback_per_region, chunk_max=self.chunk_max,
                         global_scope=self.global_scope, balances=self.balances, local_keys=self.local_keys,
                         regions=tuple(self.regions) if self.regions is not None else None,
                         hot_chunks=self.hot_chunks)


class GrantSighting(Struct, frozen=True):
    """One grant as some party saw it (the allocator's answer, a region's receipt, or etcd)."""

    lease_id: str
    pool: str
    region: str
    granted: int
    window_index: int
    epoch: int
    expires_at_ms: int | None = None  # allocator clock
    ttl_ms: int | None = None
    window_end_ms: int | None = None  # allocator clock
    starts_in_ms: int = 0
    sent_at_ms: int | None = None  # recorder clock: when the region sent the (first) request
    received_at_ms: int | None = None  # recorder clock: when the region got this answer
    commit_revision: int | None = None  # etcd mod_revision of the grant record, when known
    accepted: bool = True  # False: the region rejected it (e.g. stale epoch)
    returned: int = 0  # tokens given back to the pool by the lease's usage report (etcd record)

    @property
    def net(self) -> int:
        """Tokens this lease holds against the pool: granted minus what its report returned."""
        return self.granted - self.returned

    def content(self) -> tuple[int, int, int, str, str]:
        """What must never differ between two sightings of one lease id."""
        return (self.granted, self.window_index, self.epoch, self.pool, self.region)


class WindowStateRecord(Struct, frozen=True):
    """The allocator's own per-window state as stored in etcd (``pools/<pool>/<k>``)."""

    pool: str
    window_index: int
    limit: int
    remaining: int
    granted: int  # Σ granted over regions
    returned: int = 0  # Σ returned by usage reports


class LeaderTerm(Struct, frozen=True):
    """A leader's term. ``epoch`` is its election key's create_revision, so by construction
    ``elected_revision == epoch`` when the epoch is a revision; ``elected_at_ms`` (recorder
    clock) is when somebody observed it, used only when revisions are unavailable."""

    epoch: int
    elected_revision: int | None = None
    elected_at_ms: int | None = None
    node: str | None = None
    shard: int = 0  # the shard of leadership it leads (0: unsharded)


class SpendRecord(Struct, frozen=True):
    """Tokens admitted against a lease. ``at_ms`` on the recorder clock; None = an untimed
    summary (e.g. a lease's closing report), which the expiry check skips."""

    lease_id: str
    tokens: int
    at_ms: int | None = None
    pool: str | None = None
    region: str | None = None


class PoolAdmission(Struct, frozen=True):
    """One admission's effect on one pool (a multi-pool decision is several).

    The pool window it was admitted in is ``window_index`` — or, when the history cannot tell,
    one of ``window_index .. last_window`` (the windows of the allocator clock between the
    request's send and its answer: an answer does not name its window)."""

    pool: str
    window_index: int
    region: str
    allowed: bool
    tokens: int = 1
    fallback: bool = False  # not from a lease: a fallback allowance (regional or in-process)
    local: bool = False  # admitted while the agent's Redis was known to be unreachable (a label only)
    lease_id: str | None = None
    at_ms: int | None = None  # recorder clock
    agent: str | None = None
    last_window: int | None = None  # None: the window is certain
    certain_source: bool = True  # False: ``fallback`` may concern another pool of the same decision
    offered: bool = True  # the request reached this pool: admitted, or denied by the pool's own rule

    @property
    def windows(self) -> range:
        return range(self.window_index, max(self.window_index, self.last_window or self.window_index) + 1)


class Violation(Struct, frozen=True):
    invariant: str
    detail: str
    pool: str | None = None
    window_index: int | None = None
    lease_id: str | None = None
    observed: int | None = None
    bound: int | None = None


class WindowBound(Struct, frozen=True):
    pool: str
    window_index: int
    admitted: int
    limit: int  # G in force
    fallback_allowance: int  # Σ over regions that used fallback of their allowance
    local_allowance: int
    bound: int  # limit + fallback_allowance + local_allowance + rlqs_allowance
    rlqs_allowance: int = 0  # the bound's RLQS term: Envoys enforcing quota assignments (kernel.bound)

    @property
    def overshoot(self) -> int:
        """Admitted beyond G (may be negative: under-use)."""
        return self.admitted - self.limit

    @property
    def excess(self) -> int:
        """Admitted beyond the bound (> 0 is a violation)."""
        return self.admitted - self.bound


class BoundCheck(Struct, frozen=True):
    violations: list[Violation]
    windows: list[WindowBound]
    worst: WindowBound | None  # the window with the largest admitted - bound


#: Capacity must not be wasted when nothing fails: a window whose demand exceeded G and that nothing
#: touched admits at least this share of G (:func:`fault_free_utilisation`).
UTILISATION_FLOOR = 0.97


class Utilisation(Struct, frozen=True):
    """One pool window's use of G. ``demand``: tokens *offered to the pool* — admitted, or denied by
    the pool's own rule — by attempts that were really made and answered (not what a load generator
    meant to send, nor requests another rule denied first: no pool could have admitted those)."""

    pool: str
    window_index: int
    admitted: int
    demand: int
    limit: int
    touched: str = ""  # what touched the window (a fault, a policy change, the run's edge): reported, not judged
    # the most that may have been admitted in this window: every admission that may lie in it (one
    # answered after a boundary it was sent before counts in both windows); None: ``admitted``
    admitted_max: int | None = None

    @property
    def ratio(self) -> float:
        return self.admitted / self.limit if self.limit else 0.0

    @property
    def most(self) -> int:
        return self.admitted if self.admitted_max is None else max(self.admitted, self.admitted_max)

    @property
    def ratio_max(self) -> float:
        """``most`` / G: what the utilisation check judges."""
        return self.most / self.limit if self.limit else 0.0

    @property
    def judged(self) -> bool:
        """Judged by :func:`fault_free_utilisation`: demand above G and nothing touched the window."""
        return not self.touched and self.demand > self.limit


# ----------------------------------------------------------------------------- policy helpers
def _versions(pools: Iterable[PoolPolicy]) -> dict[str, list[PoolPolicy]]:
    out: dict[str, list[PoolPolicy]] = defaultdict(list)
    for p in pools:
        out[p.id].append(p)
    for versions in out.values():
        versions.sort(key=lambda v: -1 if v.valid_from_ms is None else v.valid_from_ms)
    return dict(out)


def policy_for_window(pools: Iterable[PoolPolicy] | Mapping[str, list[PoolPolicy]],
                      pool: str, index: int) -> PoolPolicy | None:
    """The most generous version of ``pool`` in force at any moment from when window ``index``'s
    record may have been made until the window's end: the allocator fixes a window's G when it
    makes its record, at the window's first grant, and a prefetch (``window: next``) makes it up to
    ``prefetchMs`` before the window starts - so a limit published within that time before a window
    takes effect from the next window. The version current then, plus every version taking effect
    since."""
    by_id = pools if isinstance(pools, Mapping) else _versions(pools)
    versions = by_id.get(pool)
    if not versions:
        return None
    start = index * versions[0].window_ms
    end = start + versions[0].window_ms
    opens = start - max(v.prefetch_ms for v in versions)
    current = versions[0]
    in_force = []
    for v in versions:
        if v.valid_from_ms is None or v.valid_from_ms <= opens:
            current = v
        elif v.valid_from_ms < end:
            in_force.append(v)
    in_force.append(current)
    return max(in_force, key=lambda v: (v.limit, v.fallback_per_region))


def _unique(grants: Iterable[GrantSighting]) -> list[GrantSighting]:
    """One record per distinct (lease id, content): repeated sightings are not extra grants."""
    seen: dict[tuple, GrantSighting] = {}
    for g in grants:
        seen.setdefault((g.lease_id, g.content()), g)
    return list(seen.values())


# ----------------------------------------------------------------------------- invariants
def granted_within_limit(grants: Iterable[GrantSighting], pools: Iterable[PoolPolicy]) -> list[Violation]:
    """Invariant 2: per pool and window, Σ (granted - returned) <= G (feed it etcd's own
    records). Tokens a usage report gave back (``returned``) may be granted again, so they
    count once; without usage reports this is plain Σ granted <= G."""
    by_id = _versions(pools)
    sums: dict[tuple[str, int], int] = defaultdict(int)
    out: list[Violation] = []
    for g in _unique(grants):
        if g.granted < 0:
            out.append(Violation("granted_within_limit", f"lease {g.lease_id} has negative granted {g.granted}",
                                 g.pool, g.window_index, g.lease_id, g.granted, 0))
        if not 0 <= g.returned <= g.granted:
            out.append(Violation("granted_within_limit", f"lease {g.lease_id} returned {g.returned} of {g.granted}",
                                 g.pool, g.window_index, g.lease_id, g.returned, g.granted))
        sums[(g.pool, g.window_index)] += g.net
    for (pool, index), total in sorted(sums.items()):
        policy = policy_for_window(by_id, pool, index)
        if policy is None:
            out.append(Violation("granted_within_limit", f"grants for unknown pool {pool!r}", pool, index,
                                 observed=total))
        elif total > policy.limit:
            out.append(Violation("granted_within_limit",
                                 f"pool {pool} window {index}: granted (net of returns) {total} > G {policy.limit}",
                                 pool, index, observed=total, bound=policy.limit))
    return out


def window_states_within_limit(states: Iterable[WindowStateRecord],
                               pools: Iterable[PoolPolicy]) -> list[Violation]:
    """Invariant 2 on the allocator's own window records: granted - returned <= G (the G in
    force), and the record is self-consistent: remaining == limit - (granted - returned) >= 0."""
    by_id = _versions(pools)
    out: list[Violation] = []
    for s in states:
        policy = policy_for_window(by_id, s.pool, s.window_index)
        g = s.limit if policy is None else policy.limit
        net = s.granted - s.returned
        if net > g:
            out.append(Violation("window_states_within_limit",
                                 f"pool {s.pool} window {s.window_index}: etcd says granted {s.granted} - returned "
                                 f"{s.returned} = {net} > G {g}", s.pool, s.window_index, observed=net, bound=g))
        if s.remaining < 0 or s.remaining != s.limit - net:
            out.append(Violation("window_states_within_limit",
                                 f"pool {s.pool} window {s.window_index}: remaining {s.remaining} != limit "
                                 f"{s.limit} - net granted {net}", s.pool, s.window_index, observed=s.remaining,
                                 bound=max(0, s.limit - net)))
    return out


def no_double_grant(grants: Iterable[GrantSighting]) -> list[Violation]:
    """Invariant 3: a lease id never appears with different (granted, window, epoch, pool, region)."""
    contents: dict[str, set[tuple]] = defaultdict(set)
    first: dict[str, GrantSighting] = {}
    for g in grants:
        contents[g.lease_id].add(g.content())
        first.setdefault(g.lease_id, g)
    out: list[Violation] = []
    for lease_id, seen in sorted(contents.items()):
        if len(seen) > 1:
            g = first[lease_id]
            shown = "; ".join(f"granted={c[0]} window={c[1]} epoch={c[2]} pool={c[3]} region={c[4]}"
                              for c in sorted(seen))
            out.append(Violation("no_double_grant", f"lease {lease_id} seen with {len(seen)} contents: {shown}",
                                 g.pool, g.window_index, lease_id, observed=len(seen), bound=1))
    return out


ShardOf = Callable[[str], int]


def _one_shard(_pool: str) -> int:
    return 0


def no_stale_epoch_commit(grants: Iterable[GrantSighting], leader_terms: Iterable[LeaderTerm],
                          shard_of: ShardOf | None = None) -> list[Violation]:
    """Invariant 4 (allocator side): no grant committed with epoch e after a newer epoch e' > e
    of the same shard was elected. Compared by etcd revision: the grant's ``commit_revision``
    (its record's mod_revision, read back from etcd) against the term's ``elected_revision``.
    Epochs are create_revisions, so every epoch seen on any grant is also a term elected at that
    revision. Grants without a commit revision are not judged here (wall-clock times cannot
    order a commit against an election); :func:`acknowledged_grants_persisted` ties what
    regions received to etcd's records, which carry revisions."""
    shard_of = shard_of or _one_shard
    terms: dict[tuple[int, int], LeaderTerm] = {}
    grants = list(grants)
    for t in leader_terms:
        prev = terms.get((t.shard, t.epoch))
        if prev is None or (prev.elected_revision is None and t.elected_revision is not None):
            terms[(t.shard, t.epoch)] = t
    for g in grants:  # an epoch is its shard's election key's create_revision
        shard = shard_of(g.pool)
        terms.setdefault((shard, g.epoch), LeaderTerm(epoch=g.epoch, elected_revision=g.epoch, shard=shard))
    by_shard: dict[int, list[LeaderTerm]] = defaultdict(list)
    for (shard, _e), t in terms.items():
        by_shard[shard].append(t)
    out: list[Violation] = []
    for g in _unique(grants):
        for t in by_shard[shard_of(g.pool)]:
            if t.epoch <= g.epoch:
                continue
            if (g.commit_revision is not None and t.elected_revision is not None
                    and g.commit_revision > t.elected_revision):
                out.append(Violation("no_stale_epoch_commit",
                                     f"lease {g.lease_id} committed at revision {g.commit_revision} with epoch "
                                     f"{g.epoch}, but epoch {t.epoch} was elected at revision {t.elected_revision}",
                                     g.pool, g.window_index, g.lease_id, g.commit_revision, t.elected_revision))
                break
    return out


def no_stale_epoch_accept(received: Sequence[GrantSighting], shard_of: ShardOf | None = None) -> list[Violation]:
    """Invariant 4 (region side): per region (and shard of leadership), in receipt order
    (``received_at_ms``), no accepted grant carries an epoch older than one that region already
    accepted."""
    shard_of = shard_of or _one_shard
    by_region: dict[tuple[str, int], list[GrantSighting]] = defaultdict(list)
    for g in received:
        if g.accepted and g.received_at_ms is not None:
            by_region[(g.region, shard_of(g.pool))].append(g)
    out: list[Violation] = []
    for (region, _shard), gs in sorted(by_region.items()):
        gs.sort(key=lambda g: g.received_at_ms or 0)
        newest = None
        for g in gs:
            if newest is not None and g.epoch < newest:
                out.append(Violation("no_stale_epoch_accept",
                                     f"region {region} accepted lease {g.lease_id} with epoch {g.epoch} after "
                                     f"having accepted epoch {newest}", g.pool, g.window_index, g.lease_id,
                                     g.epoch, newest))
            newest = g.epoch if newest is None else max(newest, g.epoch)
    return out


def lease_spend_within_grant(spends: Iterable[SpendRecord], grants: Iterable[GrantSighting]) -> list[Violation]:
    """Per lease: Σ tokens admitted against it <= granted - returned (a lease whose usage report
    gave tokens back may not spend them afterwards; a spend on an unknown lease is a violation
    too: tokens from nowhere). The strictest sighting of the lease counts."""
    granted: dict[str, GrantSighting] = {}
    returned: dict[str, int] = defaultdict(int)
    for g in grants:
        prev = granted.get(g.lease_id)
        returned[g.lease_id] = max(returned[g.lease_id], g.returned)
        if prev is None or g.granted < prev.granted:
            granted[g.lease_id] = g
    spent: dict[str, int] = defaultdict(int)
    for s in spends:
        spent[s.lease_id] += s.tokens
    out: list[Violation] = []
    for lease_id, total in sorted(spent.items()):
        g = granted.get(lease_id)
        if g is None:
            if total > 0:
                out.append(Violation("lease_spend_within_grant", f"{total} tokens spent on unknown lease {lease_id}",
                                     lease_id=lease_id, observed=total, bound=0))
        elif total > g.granted - returned[lease_id]:
            cap = g.granted - returned[lease_id]
            extra = f" - returned {returned[lease_id]}" if returned[lease_id] else ""
            out.append(Violation("lease_spend_within_grant",
                                 f"lease {lease_id}: spent {total} > granted {g.granted}{extra}",
                                 g.pool, g.window_index, lease_id, total, cap))
    return out


def lease_deadline_ms(records: Iterable[GrantSighting]) -> int | None:
    """When a lease stops being spendable, on the recorder clock: ``sent_at_ms + ttl_ms`` of the
    latest sighting (the region times the lease from when it sent the request; retries reuse
    the id, so the latest send is the most lenient correct reading). None if never timed."""
    best: int | None = None
    for g in records:
        if g.sent_at_ms is not None and g.ttl_ms is not None:
            d = g.sent_at_ms + g.ttl_ms
            best = d if best is None else max(best, d)
    return best


def no_spend_after_expiry(spends: Iterable[SpendRecord], grants: Iterable[GrantSighting],
                          tolerance_ms: int = DEFAULT_TOLERANCE_MS) -> list[Violation]:
    """Invariant 5: no admission is counted against a lease later than its deadline +
    ``tolerance_ms`` (recorder clock; see :func:`lease_deadline_ms`), nor after its window's end
    + tolerance (window end on the allocator clock: only meaningful when the allocator is not
    skewed against the recorder, so the window check is skipped for grants without
    ``window_end_ms``). Untimed spends (``at_ms`` None) are skipped."""
    by_lease: dict[str, list[GrantSighting]] = defaultdict(list)
    for g in grants:
        by_lease[g.lease_id].append(g)
    worst: dict[str, tuple[int, int, str]] = {}
    for s in spends:
        if s.at_ms is None or s.lease_id not in by_lease:
            continue
        recs = by_lease[s.lease_id]
        limits = []
        deadline = lease_deadline_ms(recs)
        if deadline is not None:
            limits.append((deadline, "lease deadline (sent + ttl)"))
        ends = [g.window_end_ms for g in recs if g.window_end_ms is not None]
        if ends:
            limits.append((min(ends), "window end"))
        for limit, what in limits:
            late = s.at_ms - (limit + tolerance_ms)
            if late > 0 and (s.lease_id not in worst or late > worst[s.lease_id][0]):
                worst[s.lease_id] = (late, s.at_ms, f"{what} {limit}")
    out: list[Violation] = []
    for lease_id, (late, at, what) in sorted(worst.items()):
        g = by_lease[lease_id][0]
        out.append(Violation("no_spend_after_expiry",
                             f"lease {lease_id}: spent at {at}, {late} ms after {what} + {tolerance_ms} ms tolerance",
                             g.pool, g.window_index, lease_id, at, at - late))
    return out


FaultsOf = Callable[[str, int], Faults]  # (pool, window index) -> what was unreachable in that window


def topology_of(decisions: Iterable[PoolAdmission]) -> Topology:
    """The topology a history shows when it does not state one: its regions and agents."""
    agents: dict[str, set[str]] = defaultdict(set)
    for d in decisions:
        agents[d.region].add(d.agent or "?")
    return Topology(agents={r: max(1, len(a)) for r, a in sorted(agents.items())})


def _max_flow(cap: Mapping[object, Mapping[object, int | None]], source: object, sink: object
              ) -> dict[object, dict[object, int]]:
    """Edmonds-Karp max flow on a small graph without antiparallel edges (``None`` capacity =
    unlimited); returns the flow on every original edge that carries some."""
    inf = 1 << 60
    res: dict[object, dict[object, int]] = defaultdict(dict)
    for u, outs in cap.items():
        for v, c in outs.items():
            res[u][v] = inf if c is None else c
            res[v].setdefault(u, 0)
    while True:
        parent: dict[object, object] = {source: source}
        queue = [source]
        for u in queue:
            if sink in parent:
                break
            for v, c in res[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            break
        path, v = [], sink
        while v != source:
            path.append((parent[v], v))
            v = parent[v]
        push = min(res[u][v] for u, v in path)
        for u, v in path:
            res[u][v] -= push
            res[v][u] += push
    flow: dict[object, dict[object, int]] = defaultdict(dict)
    for u, outs in cap.items():
        for v, c in outs.items():
            used = (inf if c is None else c) - res[u][v]
            if used > 0:
                flow[u][v] = used
    return flow


def _sources(counts: Mapping[tuple[str, str], int]) -> str:
    """``eu 96 (63 lease, 33 fallback); us 140 (140 lease)`` — who admitted a window's tokens how
    (``fallback?``: a fallback decision that also spent another pool; lease or fallback)."""
    regions: dict[str, dict[str, int]] = defaultdict(dict)
    for (region, kind), n in counts.items():
        if n:
            regions[region][{"fb": "fallback"}.get(kind, kind)] = n
    return "; ".join(f"{r} {sum(k.values())} (" + ", ".join(f"{n} {kind}" for kind, n in sorted(k.items())) + ")"
                     for r, k in sorted(regions.items()))


def admitted_within_bound(decisions: Iterable[PoolAdmission], pools: Iterable[PoolPolicy],
                          faults: FaultsOf | None = None, topology: Topology | None = None,
                          rlqs: Mapping[str, RlqsShape] | None = None) -> BoundCheck:
    """Invariant 6, per pool and window, with the bound of :func:`kernel.bound.pool_bound`::

        admitted <= G + Σ_{regions cut off from the allocator} F x balances
                      + Σ_{agent processes cut off from Redis} F x allowances
                      + RLQS (per Envoy x bucket x window: carry, and the fallback of Envoys cut off)

    and, per region, the admissions not paid by a lease (``fallback``) <= that region's part of
    those allowances. ``faults(pool, index)`` says what was unreachable during the window
    (nothing when absent: then the bound is G and no fallback admission is allowed); G and F
    come from the policy in force (:func:`policy_for_window`); ``topology`` gives the agents per
    region (else :func:`topology_of` the decisions); ``rlqs`` per pool the Envoys holding quota
    assignments of it (their admissions are decisions too; ``faults`` names the Envoys cut off).

    A decision whose window is uncertain (``last_window``) may be attributed to any of its
    candidate windows: the check fails only when *no* attribution of every admitted token fits
    every window's bound (a max flow from decisions to windows; exact for 1-token decisions,
    which is what every chaos gateway sends). Returns every window's figures (admitted as
    attributed) and the worst window (largest admitted - bound)."""
    decisions = [d for d in decisions if d.allowed]
    by_id = _versions(pools)
    topology = topology or topology_of(decisions)
    faults = faults or (lambda pool, index: Faults())
    out: list[Violation] = []
    windows: list[WindowBound] = []
    by_pool: dict[str, list[PoolAdmission]] = defaultdict(list)
    for d in decisions:
        by_pool[d.pool].append(d)
    for pool, ds in sorted(by_pool.items()):
        # groups of tokens with the same candidate windows and the same constraint
        groups: dict[tuple, int] = defaultdict(int)
        for d in ds:
            kind = "fb" if d.fallback and d.certain_source else ("fb?" if d.fallback else "lease")
            groups[(kind, d.region, d.window_index, d.windows[-1])] += d.tokens
        indices = sorted({k for g in groups for k in range(g[2], g[3] + 1)})
        bounds: dict[int, PoolBound] = {}
        unknown = False
        for k in indices:
            policy = policy_for_window(by_id, pool, k)
            if policy is None:
                unknown = True
                break
            bounds[k] = pool_bound(policy.shape(), topology, faults(pool, k), rlqs=(rlqs or {}).get(pool))
        if unknown:
            total = sum(d.tokens for d in ds)
            out.append(Violation("admitted_within_bound", f"admissions for unknown pool {pool!r}", pool,
                                 ds[0].window_index, observed=total))
            continue
        cap: dict[object, dict[object, int | None]] = defaultdict(dict)
        for g, tokens in groups.items():
            kind, region, first, last = g
            cap["src"][g] = tokens
            for k in range(first, last + 1):
                if kind == "fb":
                    cap[g][("fb", region, k)] = None
                    cap[("fb", region, k)][("w", k)] = bounds[k].per_region.get(region, 0)
                else:
                    cap[g][("w", k)] = None
        for k in indices:
            cap[("w", k)]["sink"] = bounds[k].total
        flow = _max_flow(cap, "src", "sink")
        admitted: dict[int, int] = defaultdict(int)
        fb_used: dict[tuple[str, int], int] = defaultdict(int)
        straddled: dict[int, int] = defaultdict(int)
        by_source: dict[int, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
        for g, tokens in groups.items():
            kind, region, first, last = g
            placed = 0
            for k in range(first, last + 1):
                f = flow.get(g, {}).get(("fb", region, k) if kind == "fb" else ("w", k), 0)
                placed += f
                admitted[k] += f
                by_source[k][(region, kind)] += f
                if kind == "fb":
                    fb_used[(region, k)] += f
                if first != last:
                    straddled[k] += f
            if placed < tokens:  # no attribution fits: show the rest in its first candidate window
                rest = tokens - placed
                admitted[first] += rest
                by_source[first][(region, kind)] += rest
                if kind == "fb":
                    fb_used[(region, first)] += rest
                if first != last:
                    straddled[first] += rest
        for k in indices:
            b = bounds[k]
            regional, local = b.term("regional fallback").tokens, b.term("in-process").tokens
            envoys = b.term(RLQS).tokens
            total = b.total if b.total is not None else admitted[k]
            if b.total is None:
                why = ("an Envoy's fallback behaviour admits without bound" if envoys is None
                       else "a tenant-scoped pool rule names no tenant")
                out.append(Violation("admitted_within_bound", f"pool {pool} window {k}: no finite bound ({why})",
                                     pool, k, observed=admitted[k]))
            wb = WindowBound(pool, k, admitted[k], b.limit, regional or 0, local or 0, total, envoys or 0)
            windows.append(wb)
            note = (f" ({straddled[k]} of them could have been admitted in a neighbouring window; "
                    "no attribution fits every window)") if straddled[k] else ""
            note += " [" + _sources(by_source[k]) + "]"
            for (region, kk), used in sorted(fb_used.items()):
                allowance = b.per_region.get(region, 0)
                if kk == k and allowance is not None and used > allowance:
                    out.append(Violation("admitted_within_bound",
                                         f"pool {pool} window {k}: region {region} admitted {used} not paid by a "
                                         f"lease > its allowance {allowance} (regional fallback + in-process, "
                                         f"for the faults in this window){note}",
                                         pool, k, observed=used, bound=allowance))
            if wb.excess > 0:
                out.append(Violation("admitted_within_bound",
                                     f"pool {pool} window {k}: admitted {admitted[k]} > bound {wb.bound} "
                                     f"(G {b.limit} + regional fallback {regional} + in-process {local}"
                                     + (f" + RLQS {envoys}: {b.term(RLQS).formula}" if (rlqs or {}).get(pool) else "")
                                     + f"){note}",
                                     pool, k, observed=admitted[k], bound=wb.bound))
    worst = max(windows, key=lambda w: (w.excess, w.overshoot)) if windows else None
    return BoundCheck(out, windows, worst)


def acknowledged_grants_persisted(received_grants: Iterable[GrantSighting],
                                  etcd_grants: Iterable[GrantSighting]) -> list[Violation]:
    """Nothing acknowledged was lost: every non-zero grant a region received exists in etcd's
    records (read back after the run) with identical content."""
    stored: dict[str, set[tuple]] = defaultdict(set)
    for g in etcd_grants:
        stored[g.lease_id].add(g.content())
    out: list[Violation] = []
    reported: set[tuple] = set()
    for g in received_grants:
        if g.granted <= 0 or (g.lease_id, g.content()) in reported:
            continue
        reported.add((g.lease_id, g.content()))
        if g.lease_id not in stored:
            out.append(Violation("acknowledged_grants_persisted",
                                 f"lease {g.lease_id} ({g.granted} tokens, epoch {g.epoch}) was received by "
                                 f"{g.region} but is not in etcd", g.pool, g.window_index, g.lease_id, g.granted))
        elif g.content() not in stored[g.lease_id]:
            out.append(Violation("acknowledged_grants_persisted",
                                 f"lease {g.lease_id}: received content {g.content()} differs from etcd's "
                                 f"{sorted(stored[g.lease_id])}", g.pool, g.window_index, g.lease_id, g.granted))
    return out


def utilisation(decisions: Iterable[PoolAdmission], pools: Iterable[PoolPolicy],
                windows: Iterable[WindowBound] | None = None,
                touched: Callable[[str, int], str] | None = None) -> list[Utilisation]:
    """Admitted / G per pool and window, with the demand offered to the pool (see
    :class:`Utilisation`): counted in each decision's first candidate window, from the decisions
    that reached the pool (``offered``). Admitted as :func:`admitted_within_bound` attributed it
    when its ``windows`` are given, and at most every admission that may lie in the window
    (``admitted_max``). ``touched(pool, index)`` names what touched a window (a fault, the run's
    edge; empty: nothing); a window in which the pool's policy changed is touched too."""
    by_id = _versions(pools)
    admitted: dict[tuple[str, int], int] = defaultdict(int)
    most: dict[tuple[str, int], int] = defaultdict(int)
    demand: dict[tuple[str, int], int] = defaultdict(int)
    for d in decisions:
        if d.offered or d.allowed:
            demand[(d.pool, d.window_index)] += d.tokens
        if d.allowed:
            for k in d.windows:
                most[(d.pool, k)] += d.tokens
            if windows is None:
                admitted[(d.pool, d.window_index)] += d.tokens
    for w in windows or ():
        admitted[(w.pool, w.window_index)] += w.admitted
        demand[(w.pool, w.window_index)] = max(demand[(w.pool, w.window_index)], w.admitted)
    out: list[Utilisation] = []
    for (pool, index), asked in sorted(demand.items()):
        policy = policy_for_window(by_id, pool, index)
        if policy is None:
            continue
        what = touched(pool, index) if touched is not None else ""
        if not what and _policy_changed(by_id.get(pool, []), index):
            what = "policy change"
        out.append(Utilisation(pool, index, admitted.get((pool, index), 0), asked, policy.limit, what,
                               most.get((pool, index), 0)))
    return out


def _policy_changed(versions: Sequence[PoolPolicy], index: int) -> bool:
    """A version of the pool took effect during window ``index`` (or G differs across versions in it)."""
    if not versions:
        return False
    start = index * versions[0].window_ms
    return any(v.valid_from_ms is not None and start < v.valid_from_ms < start + versions[0].window_ms
               for v in versions)


def fault_free_utilisation(windows: Iterable[Utilisation], floor: float = UTILISATION_FLOOR) -> list[Violation]:
    """Leases must not waste capacity when nothing fails: every window whose demand offered to the
    pool exceeded G and that nothing touched (:attr:`Utilisation.judged`) admitted at least
    ``floor`` x G — even counting in it every admission that may lie in it
    (:attr:`Utilisation.most`), a shortfall is certain. Windows a fault touched are reported, not
    judged: a fault may rightly strand tokens (a cut-off region's lease) or deny (an unreachable
    allocator, a closed rule)."""
    out: list[Violation] = []
    for u in windows:
        if not u.judged:
            continue
        need = math.ceil(round(floor * u.limit, 6))  # 0.97 x 100 is 97, not 97.00000000000001
        if u.most < need:
            between = f", {u.most} counting those that may lie in a neighbouring window" if u.most != u.admitted else ""
            out.append(Violation("fault_free_utilisation",
                                 f"pool {u.pool} window {u.window_index}: admitted {u.admitted}{between} of G "
                                 f"{u.limit} ({u.most / u.limit:.2f} < {floor}) with {u.demand} tokens of demand "
                                 "and no fault", u.pool, u.window_index, observed=u.most, bound=need))
    return out
