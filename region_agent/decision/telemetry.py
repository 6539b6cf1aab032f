"""What one finished decision records (the engine calls :meth:`DecisionTelemetry.decided` once
per decision): the decision counter, the latency histogram, new keys by source class, and the
audit trail of privileged bypasses. Hot path: label children are resolved once and cached.

Cardinality (``docs/metrics.md`` states the budget):

* ``tenant`` is a tenant *named in the bundle* (by a rule's ``tenant``; at most
  ``region_agent.decision.plan.MAX_TENANT_LABELS`` of them, in sorted order), ``other`` for every other tenant and ``none``
  for anonymous requests — never a principal, key or address;
* ``rule`` and ``route_group`` come from the bundle's rules (the route group is the deciding
  rule's), ``outcome`` is one of seven values, ``source`` one of the eleven layers of
  :class:`~region_agent.models.DecisionSource` (mostly determined by the outcome);
* ``policy_version`` keeps at most ``VERSIONS_KEPT`` versions: when a decision is made with a
  third version, the series of the oldest are removed from the registry;
* ``shard`` is ``default`` (standalone Redis) or a cluster primary's ``host:port``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from kernel.algorithms import Role
from kernel.bundle import Rule
from kernel.caches import BoundedMemo

from ..models import Decision
from ..service.audit import BypassAudit
from ..service.metrics import DECISION_SECONDS_BUCKETS, AgentMetrics
from ..service.prometheus_internals import add_observations
from .keymeter import HELD_MAX, HORIZON_S, MAX_PER_GENERATION, source_class
from .plan import Admitted, Plan, Snapshot

_CLASS = {(role, scope): source_class(role, scope) for role in Role
          for scope in ("ip", "user", "key", "route", "tenant", "global")}
VERSIONS_KEPT = 2
SHARD_CACHE_S = 30.0
CACHE_MAX = 10_000
_BOUNDS = (*DECISION_SECONDS_BUCKETS, float("inf"))  # the histogram's upper bounds, +Inf last


def tenant_label(names: frozenset[str], tenant: str | None) -> str:
    if tenant is None:
        return "none"
    return tenant if tenant in names else "other"


def count_early(m: AgentMetrics, snap: Snapshot, rule: Rule, d: Decision, tenant: str | None) -> None:
    """A decision the admission made before the engine (region_agent.decision.admission: a stale bundle's
    revocable rule, the pre-authentication cap) in ``leasehold_agent_decisions_total``, labelled
    like the engine's: so the decision counts add up to the decisions made."""
    outcome = "unavailable" if d.http_status == 503 else "denied"
    m.decisions.labels(outcome, rule.id, str(d.bundle_version), rule.route_key,
                       "none" if tenant is None else tenant_label(snap.named_tenants, tenant), d.source).inc()


class DecisionTelemetry:
    def __init__(self, metrics: AgentMetrics, *, shard_of: Callable[[str], str] | None = None,
                 audit: BypassAudit | None = None):
        self.m = metrics
        self.shard_of = shard_of
        self.audit = audit
        self._children: BoundedMemo[tuple[Any, ...], tuple[Any, Any]] = BoundedMemo(CACHE_MAX)
        self._versions: list[int] = []
        self._shards: BoundedMemo[str, str] = BoundedMemo(CACHE_MAX)
        self._shards_at = float("-inf")
        # per label since the last collection: [counter child, histogram child, count, seconds, bucket counts...]
        self._pending: dict[tuple[Any, ...], list[Any]] = {}
        # a store admission's counts by its shape's parts (plan.Shape.admitted), until the next flush:
        # id(parts) -> (parts, its pending counts); no label built or hashed per decision
        self._admitted: dict[int, tuple[Admitted, list[Any]]] = {}
        metrics.add_flush(self.flush)

    # ------------------------------------------------------------------ per decision
    def decided(self, plan: Plan, snap: Snapshot, d: Decision, seconds: float, *, now: float,
                touched_store: bool, admitted: Admitted | None = None) -> None:
        """Record one decision. ``touched_store``: its script ran (keys may have been created).
        ``admitted``: ``d`` is the store's admission made from these parts of its plan's shape as
        :func:`~region_agent.decision.record.admitted_reply` made it (allowed, ``script``, no
        fallback): its label follows from them, so its counts are found by them (once per shape
        between two collections) instead of by a label built per decision.
        The hot path: everything inline, label children cached (``make bench`` figures 2 and 3)."""
        p = None
        if admitted is not None and self.shard_of is None:
            hit = self._admitted.get(id(admitted))
            if hit is not None and hit[0] is admitted:
                p = hit[1]
                outcome = "allowed"
        if p is None:
            if d.allowed:
                outcome = "fallback_allowed" if d.fallback else "allowed"
            elif d.reason == "OVERLOADED":
                outcome = "shed"  # this agent saturated while the store answered (docs/concepts.md: overload is shed)
            elif d.http_status == 503:
                outcome = "unavailable"
            elif d.http_status == 409:
                outcome = "conflict"  # a reused requestId with another question (nothing charged)
            else:
                outcome = "fallback_denied" if d.fallback else "denied"
            tenant = plan.tenant
            shard = "default" if self.shard_of is None else self._shard(plan, now)
            label = (outcome, d.rule_id, d.bundle_version,
                     "none" if tenant is None else tenant if tenant in snap.named_tenants else "other", shard, d.source)
            # counted here, moved into the counter and the histogram when the registry is collected
            # (flush): two locked prometheus updates per decision were a tenth of its CPU
            p = self._pending.get(label)
            if p is None:
                children = self._children.get(label)
                if children is None:
                    children = self._resolve(label, snap)
                p = self._pending[label] = [children[0], children[1], 0, 0.0, *([0] * len(_BOUNDS))]
            if admitted is not None and self.shard_of is None:  # found by the shape's parts until the next flush
                if len(self._admitted) >= CACHE_MAX:
                    self._admitted.clear()
                self._admitted[id(admitted)] = (admitted, p)
        if seconds < 0:
            seconds = 0.0
        p[2] += 1
        p[3] += seconds
        p[4 + bisect_left(_BOUNDS, seconds)] += 1
        if touched_store:
            meter = self.m.new_keys
            if now - meter.since >= HORIZON_S:
                meter.rotate(now)
            calls = plan.calls
            held = meter.held
            if held.get(id(calls)) is not calls:  # else: every key of these calls is in the current generation
                cur, prev, counts = meter.cur, meter.prev, meter.counts
                every = True
                for call, slot in zip(calls, plan.slots, strict=False):
                    h = hash(call.key)  # str hashes are cached on the key string
                    if h in cur:
                        continue
                    if h not in prev:
                        counts[_CLASS[slot.role, slot.rule.scope]] += 1
                    if len(cur) < MAX_PER_GENERATION:
                        cur.add(h)
                    else:
                        every = False
                if every and plan.text is not None:  # a remembered question: the same calls at every asking
                    if len(held) >= HELD_MAX:
                        held.clear()
                    held[id(calls)] = calls
            if plan.decision_ttl_ms > 0 and calls:
                meter.counts["decision"] += 1
        rules = plan.rules
        if rules and rules[0].exempt and self.audit is not None:
            self.audit.decided(rules[0], outcome=outcome, tenant=plan.tenant, request_id=plan.request_id,
                               version=snap.bundle.bundle_version, fallback=d.fallback)

    def flush(self) -> None:
        """Move the counts kept since the last collection into the registry (``AgentMetrics`` runs
        this first in every collection). A histogram child takes a whole bucket count at once
        (region_agent.service.prometheus_internals; a unit test compares the exposition with ``observe``'s)."""
        self._admitted = {}  # (their pending counts are moved below)
        pending, self._pending = self._pending, {}
        for counter, hist, count, total, *buckets in pending.values():
            counter.inc(count)
            add_observations(hist, total, buckets)

    # ------------------------------------------------------------------ helpers
    def _shard(self, plan: Plan, now: float) -> str:
        """The cluster primary owning the plan's hash tag (cached per tag; the cache is dropped
        every ``SHARD_CACHE_S`` so a resharding or failover shows within that time)."""
        if now - self._shards_at >= SHARD_CACHE_S:
            self._shards.clear()
            self._shards_at = now
        tag = plan.tenant or plan.decision_key
        shard = self._shards.get(tag)
        if shard is None:
            shard = self._shards.put(tag, self.shard_of(plan.decision_key))  # type: ignore[misc]  # the shard function is set whenever shards are counted
        return shard

    def _resolve(self, label: tuple[Any, ...], snap: Snapshot) -> tuple[Any, Any]:
        outcome, rule_id, version, tenant, shard, source = label
        if version not in self._versions:
            self._new_version(version)
        rule = snap.rules_by_id.get(rule_id) if rule_id else None
        return self._children.put(label, (
            self.m.decisions.labels(outcome, rule_id or "none", str(version), rule.route_key if rule else "none",
                                    tenant, source),
            self.m.latency.labels(shard, outcome)))

    def _new_version(self, version: int) -> None:
        """Keep the series of the last ``VERSIONS_KEPT`` versions; drop the oldest."""
        self.flush()  # counts of the version about to be dropped are not kept for a removed child
        self._versions.append(version)
        self._versions.sort()
        while len(self._versions) > VERSIONS_KEPT:
            old = str(self._versions.pop(0))
            for k in [k for k in self._children if str(k[2]) == old]:
                del self._children[k]
            metric = self.m.decisions
            for labels in [lv for lv in list(getattr(metric, "_metrics", {})) if lv[2] == old]:
                metric.remove(*labels)
