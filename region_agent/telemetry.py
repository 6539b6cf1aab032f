"""What one finished decision records (the engine calls :meth:`DecisionTelemetry.decided` once
per decision): the decision counter, the latency histogram, new keys by source class, and the
audit trail of privileged bypasses. Hot path: label children are resolved once and cached.

Cardinality (``docs/metrics.md`` states the budget):

* ``tenant`` is a tenant *named in the bundle* (by a rule's ``tenant``; at most
  ``MAX_TENANT_LABELS`` of them, in sorted order), ``other`` for every other tenant and ``none``
  for anonymous requests — never a principal, key or address;
* ``rule`` and ``route_group`` come from the bundle's rules (the route group is the deciding
  rule's), ``outcome`` is one of five values;
* ``policy_version`` keeps at most ``VERSIONS_KEPT`` versions: when a decision is made with a
  third version, the series of the oldest are removed from the registry;
* ``shard`` is ``default`` (standalone Redis) or a cluster primary's ``host:port``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernel.bundle import Bundle

from .audit import BypassAudit
from .keymeter import source_class
from .metrics import AgentMetrics
from .models import Decision
from .plan import Plan, memo_of

MAX_TENANT_LABELS = 50
VERSIONS_KEPT = 2
CACHE_MAX = 10_000


def named_tenants(bundle: Bundle) -> frozenset[str]:
    return frozenset(sorted({r.tenant for r in bundle.rules if r.tenant})[:MAX_TENANT_LABELS])


def tenant_label(names: frozenset[str], tenant: str | None) -> str:
    if tenant is None:
        return "none"
    return tenant if tenant in names else "other"


def outcome_of(d: Decision) -> str:
    if d.allowed:
        return "fallback_allowed" if d.fallback else "allowed"
    if d.http_status == 503:
        return "unavailable"
    return "fallback_denied" if d.fallback else "denied"


class DecisionTelemetry:
    def __init__(self, metrics: AgentMetrics, *, shard_of: Callable[[str], str] | None = None,
                 audit: BypassAudit | None = None):
        self.m = metrics
        self.shard_of = shard_of
        self.audit = audit
        self._children: dict[tuple, tuple[Any, Any]] = {}
        self._tenants: tuple[int, frozenset[str]] = (-1, frozenset())
        self._versions: list[int] = []
        self._shards: dict[str, str] = {}

    # ------------------------------------------------------------------ per decision
    def decided(self, plan: Plan, bundle: Bundle, d: Decision, seconds: float, *, now: float,
                touched_store: bool) -> None:
        """Record one decision. ``touched_store``: its script ran (keys may have been created)."""
        outcome = outcome_of(d)
        shard = self._shard(plan)
        tenant = plan.tenant
        label = (outcome, d.policy_id, d.policy_version,
                 "none" if tenant is None else tenant if tenant in self._names(bundle) else "other", shard)
        children = self._children.get(label)
        if children is None:
            children = self._resolve(label, bundle)
        children[0].inc()
        children[1].observe(seconds if seconds > 0 else 0.0)
        if touched_store:
            self.m.new_keys.touch(self._keys(plan), now)
        rules = plan.rules
        if self.audit is not None and rules and rules[0].exempt:
            self.audit.decided(rules[0], outcome=outcome, tenant=plan.tenant, request_id=plan.request_id,
                               version=bundle.bundle_version, fallback=d.fallback)

    def count(self, bundle: Bundle, d: Decision, tenant: str | None, route_group: str) -> None:
        """A decision made outside the engine (e.g. POLICY_STALE): the counter only."""
        self.m.decisions.labels(outcome_of(d), d.policy_id or "none", str(d.policy_version), route_group,
                                tenant_label(self._names(bundle), tenant)).inc()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _keys(plan: Plan):
        for call, slot in zip(plan.calls, plan.slots, strict=False):
            yield call.key, source_class(slot.role, slot.rule.scope)
        for call, slot in zip(plan.shadow_calls, plan.shadow_slots, strict=False):
            yield call.key, source_class(slot.role, slot.rule.scope)
        if plan.decision_ttl_ms > 0 and plan.calls:
            yield plan.decision_key, "decision"

    def _shard(self, plan: Plan) -> str:
        if self.shard_of is None:
            return "default"
        tag = plan.tenant or plan.decision_key
        shard = self._shards.get(tag)
        if shard is None:
            if len(self._shards) >= CACHE_MAX:
                self._shards.clear()
            shard = self._shards[tag] = self.shard_of(plan.decision_key)
        return shard

    def forget_shards(self) -> None:
        """Cluster topology may have changed (called by the store-health poll)."""
        self._shards.clear()

    def _names(self, bundle: Bundle) -> frozenset[str]:
        if self._tenants[0] != id(bundle):
            self._tenants = (id(bundle), named_tenants(bundle))
        return self._tenants[1]

    def _resolve(self, label: tuple, bundle: Bundle) -> tuple[Any, Any]:
        outcome, rule_id, version, tenant, shard = label
        if version not in self._versions:
            self._new_version(version)
        rule = memo_of(bundle).rules_by_id.get(rule_id) if rule_id else None
        if len(self._children) >= CACHE_MAX:
            self._children.clear()
        children = self._children[label] = (
            self.m.decisions.labels(outcome, rule_id or "none", str(version), rule.route_key if rule else "none",
                                    tenant),
            self.m.latency.labels(shard, outcome))
        return children

    def _new_version(self, version: int) -> None:
        """Keep the series of the last ``VERSIONS_KEPT`` versions; drop the oldest."""
        self._versions.append(version)
        self._versions.sort()
        while len(self._versions) > VERSIONS_KEPT:
            old = str(self._versions.pop(0))
            self._children = {k: v for k, v in self._children.items() if str(k[2]) != old}
            metric = self.m.decisions
            for labels in [lv for lv in list(getattr(metric, "_metrics", {})) if lv[2] == old]:
                metric.remove(*labels)
