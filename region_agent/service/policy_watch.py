"""The agent's side of policy distribution through etcd (docs/invariants.md I13).

* :func:`make_watcher` follows ``<prefix>policy/current`` and feeds the :class:`PolicyHolder`
  (strictly higher versions only; corrupt values are refused and counted as ``invalid``; with
  ``--policy-public-keys`` a value is verified before it is validated, and one that does not verify
  is counted by its signature outcome, never validated).
* :func:`revoked_decision` is the conservative behaviour of ``revocable`` rules once the
  snapshot is older than the bundle's ``maxAgeMs`` (no successful etcd read for that long):
  a request whose selected, enforced rules include a revocable one is **denied with 503**,
  reason ``POLICY_STALE``, ``Retry-After`` from the rule's ``closedRetryAfterMs`` — the same
  answer as ``failMode: closed`` with the store down. Nothing is sent to Redis for it.
  Non-revocable rules keep being enforced from the last good bundle.
"""

from __future__ import annotations

from typing import Any

from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdRefused, EtcdStore
from kernel.policy_store import PolicyStore, policy_key
from kernel.signing import TrustedKeys
from kernel.watch import PolicyWatcher

from ..decision.outcome import Answer
from ..decision.plan import Snapshot, check_principal
from ..decision.record import early_record
from ..models import AdmitRequest, Decision, DecisionSource, DeniedScope, Reason
from .metrics import AgentMetrics
from .policy import PolicyHolder

# what each refusal at start asks the operator to check (EtcdRefused.cause; NOSPACE refuses no read)
_START_REFUSALS = {
    "auth": "etcd refused the agent's credentials for its policy source (authentication failed for user {user}): "
            "check --policy-etcd-user and its password (LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD or "
            "--policy-etcd-password-file), and that the user exists (deploy/etcd/leasehold-roles.sh creates it)",
    "permission": "etcd denied the agent's read of {key} (user {user}): its role must read policy/ under "
                  "{prefix} (deploy/etcd/leasehold-roles.sh grants it)",
    "tls": "the TLS handshake with the policy etcd failed on every endpoint: etcd's certificate must verify "
           "against --policy-etcd-ca-file and name the endpoint's host, and etcd must accept "
           "--policy-etcd-cert-file (signed by its --trusted-ca-file, not expired)",
}


def etcd_store(endpoints: str, *, timeout_ms: int = 1000, user: str | None = None, password: str | None = None,
               tls: Any = None, report_refusals: bool = True) -> EtcdStore:
    """The agent's etcd client for its policy source. ``tls``: the link's channel credentials
    (``region_agent.service.settings.policy_etcd_tls``)."""
    kw = {"user": user, "password": password} if user else {}
    return EtcdStore(endpoints, timeout_s=timeout_ms / 1000, tls=tls, report_refusals=report_refusals, **kw)


async def etcd_refusal(store: EtcdStore, *, prefix: str, user: str | None,
                       trusted: TrustedKeys | None = None) -> str | None:
    """Why the agent must not start on its policy etcd: the credentials, the role's read of the
    policy keys or the TLS handshake refused (:class:`kernel.etcd_store.EtcdRefused`, as the
    allocator's start, docs/decisions/0065). One read of the keys the watcher reads. None when
    there is nothing to refuse, also when etcd does not answer now: the agent then starts on its
    start bundle and follows etcd once it answers (its age says how long it has not). ``trusted``: the
    agent's keys (what is read is verified before it is validated, as the watcher reads)."""
    try:
        await PolicyStore(store, prefix, trusted=trusted).read_both()
    except EtcdRefused as e:
        if e.cause not in _START_REFUSALS:
            return None
        who = user or "(none: --policy-etcd-user is not set, and etcd's authentication is on)"
        return _START_REFUSALS[e.cause].format(user=who, prefix=prefix, key=policy_key(prefix).decode())
    except LeaseholdError:
        return None
    return None


def make_watcher(holder: PolicyHolder, endpoints: str, *, prefix: str, reread_ms: int, timeout_ms: int = 1000,
                 user: str | None = None, password: str | None = None, tls: Any = None) -> PolicyWatcher:
    """``tls``: the link's channel credentials (``region_agent.service.settings.policy_etcd_tls``)."""
    store = etcd_store(endpoints, timeout_ms=timeout_ms, user=user, password=password, tls=tls)
    return PolicyWatcher(PolicyStore(store, prefix, trusted=holder.trusted), offer=holder.offer, refuse=holder.refuse,
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
