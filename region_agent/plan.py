"""Turn one admission request and one policy snapshot into the script calls of its decision.

Pure: no I/O, no clock. The adapter converts :class:`Call` into the store's ``RuleCall``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kernel.bundle import Bundle, Pool, Rule, select_rules
from kernel.errors import ValidationFailed

from .keys import KeyBuilder, check_ids, check_route, check_tenant, parse_ip
from .models import AdmitRequest, Principal

KIND = {"token_bucket": "tb", "gcra": "gcra", "fixed_window": "fw", "sliding_counter": "sc",
        "sliding_log": "sl", "pool": "pool"}
Role = Literal["rate", "cc", "pool"]


# immutable records built per decision: NamedTuples (created in C) rather than frozen dataclasses
class Call(NamedTuple):
    key: str
    kind: str
    params: tuple[int, int, int, int, int]


class Slot(NamedTuple):
    rule: Rule
    role: Role


class GlobalSpend(NamedTuple):
    rule: Rule
    pool: Pool
    cost: int  # whole tokens


@dataclass(slots=True)
class Plan:
    request_id: str
    tenant: str | None
    principal_type: str
    rules: list[Rule]  # every selected enforced rule, evaluation order (incl. global pools); shared, read-only
    calls: list[Call] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    shadow_calls: list[Call] = field(default_factory=list)
    shadow_slots: list[Slot] = field(default_factory=list)
    global_spends: list[GlobalSpend] = field(default_factory=list)
    rule_keys: dict[str, str] = field(default_factory=dict)  # rule id -> state key (in-process only)
    decision_key: str = ""
    decision_ttl_ms: int = 0
    question: str = ""  # what the decision record answers (keys.KeyBuilder.question); '' without a record
    slack_ms: int = 0
    cost_hint: int = 1

    @property
    def anonymous(self) -> bool:
        return self.principal_type == "anonymous"


def check_principal(req_tenant: str | None, principal: Principal):
    """Validate identity fields beyond the schema; returns (tenant, addr or None)."""
    if principal.type == "anonymous":
        addr = parse_ip(principal.id)
        tenant = check_tenant(req_tenant) if req_tenant is not None else None
        return tenant, addr
    if req_tenant is None:
        raise ValidationFailed("tenantId is required for an authenticated principal",
                               errors=["tenantId: required unless principal.type is anonymous"])
    return check_tenant(req_tenant), None


def rate_params(rule: Rule, cost_hint: int) -> tuple[int, int, int, int, int]:
    if rule.algorithm in ("token_bucket", "gcra"):
        return (rule.capacity_millis or 0, rule.refill_millis or 0, rule.period_ms or 0,
                (rule.cost_millis or 0) * cost_hint, 0)
    if rule.algorithm == "pool":
        return (rule.cost * cost_hint, 0, 0, 0, 0)
    return (rule.limit or 0, rule.window_ms or 0, cost_hint, 0, 0)


SELECTION_CACHE_MAX = 10_000  # distinct (tenant, route, principal type, has key) per snapshot


class Shape(NamedTuple):
    """The request-independent part of a plan: the rules one (tenant, route group, principal
    type, has key) selects and what follows from them. Shared: callers must not modify it."""

    rules: list[Rule]  # every selected rule, evaluation order (shadow ones too)
    enforced: list[Rule]
    in_script: list[Rule]  # enforced rules with a tenant-tagged key (not fleet-wide pools), in order
    shadow: list[Rule]  # shadow rules evaluated (fleet-wide pools never: they would spend leased tokens)
    ip_rules: list[Rule]
    slack_ms: int
    decision_ttl_ms: int

    @classmethod
    def of(cls, rules: list[Rule]) -> Shape:
        enforced = [r for r in rules if not r.shadow]
        in_script = [r for r in enforced if not _fleet_wide(r)]
        return cls(rules=rules, enforced=enforced, in_script=in_script,
                   shadow=[r for r in rules if r.shadow and not _fleet_wide(r)],
                   ip_rules=[r for r in rules if r.scope == "ip"],
                   slack_ms=max((r.ttl_slack_ms for r in in_script), default=0),
                   decision_ttl_ms=(max(r.decision_ttl_ms for r in in_script)
                                    if any(r.idempotent for r in in_script) else 0))


def _fleet_wide(rule: Rule) -> bool:
    return rule.algorithm == "pool" and rule.scope == "global"


class BundleMemo:
    """Lookups of one policy snapshot that do not depend on the request: pools and rules by id,
    and the :class:`Shape` per (tenant, route group, principal type, has key). A bundle is
    immutable, so these stay valid for its lifetime; only validated tenants and routes reach
    the cache, and it is cleared when it reaches ``SELECTION_CACHE_MAX`` entries."""

    __slots__ = ("_shapes", "bundle", "pools", "rules_by_id")

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.pools: dict[str, Pool] = {p.id: p for p in bundle.pools}
        self.rules_by_id: dict[str, Rule] = {r.id: r for r in bundle.rules}
        self._shapes: dict[tuple, Shape] = {}

    def shape(self, tenant: str | None, route_group: str, principal_type: str, has_key: bool) -> Shape:
        k = (tenant, route_group, principal_type, has_key)
        hit = self._shapes.get(k)
        if hit is None:
            if len(self._shapes) >= SELECTION_CACHE_MAX:
                self._shapes.clear()
            hit = self._shapes[k] = Shape.of(select_rules(self.bundle.rules, tenant=tenant, route_group=route_group,
                                                          principal_type=principal_type, has_key=has_key))
        return hit


_last_memo: BundleMemo | None = None


def memo_of(bundle: Bundle) -> BundleMemo:
    """The memo of ``bundle`` (one slot: the snapshot in force; a new snapshot replaces it)."""
    global _last_memo
    m = _last_memo
    if m is None or m.bundle is not bundle:
        m = _last_memo = BundleMemo(bundle)
    return m


def selected(bundle: Bundle, *, tenant: str | None, route_group: str, principal: Principal) -> list[Rule]:
    return list(memo_of(bundle).shape(tenant, route_group, principal.type, principal.api_key_id is not None).rules)


def build_plan(bundle: Bundle, req: AdmitRequest, keys: KeyBuilder) -> Plan:
    check_ids(req.request_id, req.route_group)
    principal = req.principal
    tenant, addr = check_principal(req.tenant_id, principal)
    memo = memo_of(bundle)
    shape = memo.shape(tenant, req.route_group, principal.type, principal.api_key_id is not None)
    cost_hint = req.cost_hint
    plan = Plan(request_id=req.request_id, tenant=tenant, principal_type=principal.type,
                rules=shape.enforced, cost_hint=cost_hint, slack_ms=shape.slack_ms,
                decision_ttl_ms=shape.decision_ttl_ms)
    ip_tag = keys.ip_tag(addr, shape.ip_rules) if addr is not None else None
    user_id = principal.id if principal.type == "user" else None

    def key_of(rule: Rule) -> str:
        if rule.algorithm == "pool":
            assert rule.pool is not None
            return keys.tenant_pool_key(tenant or "", rule.pool)
        return keys.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=principal.api_key_id,
                             route_group=req.route_group, ip_tag=ip_tag, addr=addr)

    if len(shape.in_script) != len(shape.enforced):
        for rule in shape.enforced:
            if _fleet_wide(rule):
                assert rule.pool is not None
                plan.global_spends.append(GlobalSpend(rule, memo.pools[rule.pool], rule.cost * cost_hint))
    calls, slots = plan.calls, plan.slots
    for rule in shape.in_script:
        key = key_of(rule)
        plan.rule_keys[rule.id] = key
        if rule.concurrency_max is not None:
            calls.append(Call(KeyBuilder.cc_key(key), "cc", (rule.concurrency_max, rule.concurrency_ttl_ms, 0, 0, 0)))
            slots.append(Slot(rule, "cc"))
        calls.append(Call(key, KIND[rule.algorithm], rate_params(rule, cost_hint)))
        slots.append(Slot(rule, "pool" if rule.algorithm == "pool" else "rate"))
    for rule in shape.shadow:
        plan.shadow_calls.append(Call(key_of(rule), KIND[rule.algorithm], rate_params(rule, cost_hint)))
        plan.shadow_slots.append(Slot(rule, "pool" if rule.algorithm == "pool" else "rate"))
    dk_tenant = tenant if ip_tag is None else None
    if plan.decision_ttl_ms > 0:
        plan.decision_key = keys.decision_key(req.request_id, tenant=dk_tenant, ip_tag=ip_tag)
        plan.question = keys.question(tenant=tenant, principal_type=principal.type, principal_id=principal.id,
                                      api_key_id=principal.api_key_id, route_group=req.route_group,
                                      cost_hint=cost_hint)
    else:
        plan.decision_key = KeyBuilder.unrecorded_decision_key(tenant=dk_tenant, ip_tag=ip_tag)
    return plan


def cc_gates(bundle: Bundle, *, request_tenant: str | None, principal: Principal, route_group: str,
             keys: KeyBuilder) -> list[tuple[str, Rule]]:
    """(key, rule) of every concurrency gate an admission with these attributes would have acquired."""
    check_route(route_group)
    tenant, addr = check_principal(request_tenant, principal)
    out: list[tuple[str, Rule]] = []
    if addr is not None:
        return out  # ip rules carry no concurrency gates (bundle validation)
    user_id = principal.id if principal.type == "user" else None
    for rule in selected(bundle, tenant=tenant, route_group=route_group, principal=principal):
        if rule.shadow or rule.concurrency_max is None:
            continue
        key = keys.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=principal.api_key_id,
                            route_group=route_group)
        out.append((KeyBuilder.cc_key(key), rule))
    return out


def cc_keys_for_release(bundle: Bundle, *, request_tenant: str | None, principal: Principal,
                        route_group: str, keys: KeyBuilder) -> list[str]:
    """The concurrency gates an admission with these attributes would have acquired."""
    return [key for key, _ in cc_gates(bundle, request_tenant=request_tenant, principal=principal,
                                       route_group=route_group, keys=keys)]


def tokens_limit(rule: Rule, pools: dict[str, Pool]) -> int:
    """The rule's limit in whole tokens/requests (what the decision reports)."""
    if rule.algorithm in ("token_bucket", "gcra"):
        return (rule.capacity_millis or 0) // 1000
    if rule.algorithm == "pool":
        pool = pools.get(rule.pool or "")
        return pool.limit if pool else 0
    return rule.limit or 0


def tokens_remaining(rule: Rule, raw: int) -> int:
    """Script ``remaining`` (millitokens for buckets, units otherwise) as whole tokens, floored."""
    if rule.algorithm in ("token_bucket", "gcra"):
        return max(0, raw) // 1000
    return max(0, raw)


__all__ = ["BundleMemo", "Call", "GlobalSpend", "Plan", "Shape", "Slot", "build_plan", "cc_gates", "cc_keys_for_release",
           "check_principal", "memo_of", "tokens_limit", "tokens_remaining"]
