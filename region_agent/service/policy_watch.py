"""The agent's side of policy distribution through etcd (docs/invariants.md I13).

* :func:`make_watcher` follows ``<prefix>policy/current`` and feeds the :class:`PolicyHolder`
  (strictly higher versions only; corrupt values are refused and counted as ``invalid``).
* :func:`revoked_decision` is the conservative behaviour of ``revocable`` rules once the
  snapshot is older than the bundle's ``maxAgeMs`` (no successful etcd read for that long):
  a request whose selected, enforced rules include a revocable one is **denied with 503**,
  reason ``POLICY_STALE``, ``Retry-After`` from the rule's ``closedRetryAfterMs`` — the same
  answer as ``failMode: closed`` with the store down. Nothing is sent to Redis for it.
  Non-revocable rules keep being enforced from the last good bundle.
"""

from __future__ import annotations

from typing import Any

from kernel.etcd_store import EtcdStore
from kernel.policy_store import PolicyStore
from kernel.watch import PolicyWatcher

from ..decision.outcome import Answer
from ..decision.plan import Snapshot, check_principal
from ..decision.record import early_record
from ..models import AdmitRequest, Decision, DecisionSource, DeniedScope, Reason
from .metrics import AgentMetrics
from .policy import PolicyHolder


def make_watcher(holder: PolicyHolder, endpoints: str, *, prefix: str, reread_ms: int, timeout_ms: int = 1000,
                 user: str | None = None, password: str | None = None, tls: Any = None) -> PolicyWatcher:
    """``tls``: the link's channel credentials (``region_agent.service.settings.policy_etcd_tls``)."""
    kw = {"user": user, "password": password} if user else {}
    store = EtcdStore(endpoints, timeout_s=timeout_ms / 1000, tls=tls, **kw)
    return PolicyWatcher(PolicyStore(store, prefix), offer=holder.offer, refuse=holder.refuse_invalid,
                         reread_s=reread_ms / 1000, offer_canary=holder.offer_canary)


def age_gauge(m: AgentMetrics, watcher: PolicyWatcher) -> None:
    """``leasehold_agent_policy_age_seconds``: time since the last successful etcd read."""
    m.policy_age.set_function(lambda: watcher.age_ms() / 1000.0)


def revoked_decision(snap: Snapshot, req: AdmitRequest, m: AgentMetrics | None = None) -> Decision | None:
    """The denial for ``req`` (decoded) when its rules include a revocable one (call only when stale)."""
    tenant, _addr = check_principal(req.tenant_id, req.principal)
    rules = snap.selected(tenant=tenant, route_group=req.route_group, principal=req.principal)
    rule = next((r for r in rules if r.revocable and not r.shadow), None)
    if rule is None:
        return None
    anonymous = req.principal.type == "anonymous"
    answer = Answer(False, None if anonymous else rule, scope=DeniedScope(rule.scope), reason=Reason.POLICY_STALE,
                    retry=rule.closed_retry_after_ms)
    return early_record(req, snap, answer, DecisionSource.POLICY, m, counted=rule, tenant=tenant)
