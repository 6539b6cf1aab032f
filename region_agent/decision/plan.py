"""Turn one admission request and one policy snapshot into the script calls of its decision.

Pure: no I/O, no clock. Its rule slots (:class:`~region_agent.decision.call.Call`) become the script call
(:mod:`region_agent.decision.call`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kernel.algorithms import Role
from kernel.algorithms.concurrency import KIND as CONCURRENCY
from kernel.algorithms.pool import PoolRule
from kernel.algorithms.rule import Params
from kernel.bundle import Bundle, Pool, Rule, every_request_rules, select_rules
from kernel.caches import BoundedMemo
from kernel.errors import ScriptRejected, ValidationFailed

from ..models import AdmitRequest, Principal
from .call import Call, multi_rule_argv
from .keys import KeyBuilder, KeyTemplate, check_ids, check_route, check_tenant, parse_ip

# immutable records built per decision: NamedTuples rather than frozen dataclasses; the hot path
# builds them with tuple.__new__ (a NamedTuple's own __new__ is a Python function: a tenth of build_plan)
_new = tuple.__new__


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
    slots: list[Slot] = field(default_factory=list)  # shared with the plan's Shape: read-only
    shadow_calls: Sequence[Call] = ()  # read-only
    shadow_slots: list[Slot] = field(default_factory=list)  # shared with the plan's Shape: read-only
    global_spends: Sequence[GlobalSpend] = ()  # read-only
    decision_key: str = ""
    decision_ttl_ms: int = 0
    question: str = ""  # what the decision record answers (keys.KeyBuilder.question); '' without a record
    slack_ms: int = 0
    cost_hint: int = 1
    # ARGV of ``multi_rule.lua`` between the member and the question (every slot's kind and five
    # parameters), checked once per Shape and cost (region_agent.decision.call.multi_rule_call); None: the
    # calls are built and checked per request
    argv_rules: tuple | None = None
    has_pool: bool = False  # a slot spends a tenant pool balance (Role.POOL)
    shape: Shape | None = None  # what the plan was built from (shared, read-only)
    request: AdmitRequest | None = None  # the question (the sampled decision log reads the principal from it)
    # the pre-authentication stage of an authenticated request (ip rules marked everyRequest,
    # keyed by its clientIp): decided first, in its own call (another hash tag than the tenant's)
    edge: Plan | None = None

    @property
    def anonymous(self) -> bool:
        return self.principal_type == "anonymous"

    @property
    def rule_keys(self) -> dict[str, str]:
        """Rule id -> its state key (in-process only: the local fallback's buckets)."""
        return {slot.rule.id: call.key for slot, call in zip(self.slots, self.calls, strict=False)
                if slot.role is not Role.CC}


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


SELECTION_CACHE_MAX = 10_000  # distinct (tenant, route, principal type, has key) per snapshot


class Shape(NamedTuple):
    """The request-independent part of a plan: the rules one (tenant, route group, principal
    type, has key) selects and what follows from them — their slots, their keys up to the
    principal hash (:class:`~region_agent.decision.keys.KeyTemplate`), their script parameters per cost.
    Shared: callers must not modify it."""

    rules: list[Rule]  # every selected rule, evaluation order (shadow ones too)
    enforced: list[Rule]
    in_script: list[Rule]  # enforced rules with a tenant-tagged key (not fleet-wide pools), in order
    shadow: list[Rule]  # shadow rules evaluated (fleet-wide pools never: they would spend leased tokens)
    ip_rules: list[Rule]
    slack_ms: int
    decision_ttl_ms: int
    # per in_script / shadow rule: its key template for the shape's tenant (None: derived per request)
    templates: tuple[KeyTemplate | None, ...]
    shadow_templates: tuple[KeyTemplate | None, ...]
    slots: list[Slot]  # the script call's slots (a concurrency gate before its rule's own slot)
    shadow_slots: list[Slot]
    fleet: list[Rule]  # enforced fleet-wide pool rules (spent from in-process chunks)
    has_pool: bool  # a slot is a tenant pool rule (Role.POOL)
    unrecorded_dk: str | None  # KEYS[1] without a decision record for the tenant tag (None: per request)
    by_cost: dict[int, tuple[list[tuple[str, Params]], list[tuple[str, Params]], tuple | None]]
    # what other modules derive from the shape once, by their own key (region_agent.decision.record: the
    # parts of an admission's record); cleared with the shape
    derived: dict
    # an authenticated shape's pre-authentication stage: the shape of the ip rules marked
    # everyRequest on its route (None: there are none, or the shape is anonymous already)
    edge: Shape | None = None

    @classmethod
    def of(cls, rules: list[Rule], tenant: str | None = None) -> Shape:
        enforced = [r for r in rules if not r.shadow]
        in_script = [r for r in enforced if not r.fleet_wide]
        shadow = [r for r in rules if r.shadow and not r.fleet_wide]
        slots: list[Slot] = []
        for rule in in_script:
            if rule.concurrency_max is not None:
                slots.append(Slot(rule, Role.CC))
            slots.append(Slot(rule, rule.role))
        try:
            dk = KeyBuilder.unrecorded_decision_key(tenant=tenant) if tenant is not None else None
        except ValidationFailed:
            dk = None
        return cls(rules=rules, enforced=enforced, in_script=in_script, shadow=shadow,
                   ip_rules=[r for r in rules if r.scope == "ip"],
                   slack_ms=max((r.ttl_slack_ms for r in in_script), default=0),
                   decision_ttl_ms=(max(r.decision_ttl_ms for r in in_script)
                                    if any(r.idempotent for r in in_script) else 0),
                   templates=tuple(KeyBuilder.template(r, tenant) for r in in_script),
                   shadow_templates=tuple(KeyBuilder.template(r, tenant) for r in shadow),
                   slots=slots, shadow_slots=[Slot(r, r.role) for r in shadow],
                   fleet=[r for r in enforced if isinstance(r, PoolRule) and r.fleet_wide],
                   has_pool=any(s.role is Role.POOL for s in slots), unrecorded_dk=dk, by_cost={}, derived={})

    def params_for(self, cost_hint: int) -> tuple[list[tuple[str, Params]], list[tuple[str, Params]], tuple | None]:
        """(kind, params) of every slot and shadow slot for a request of ``cost_hint``, and the
        tenant call's ARGV between member and question (None when the slots do not make a valid
        call: it is then built per request, and refused there with the script's own error)."""
        hit = self.by_cost.get(cost_hint)
        if hit is not None:
            return hit
        specs: list[tuple[str, Params]] = []
        for rule in self.in_script:
            if rule.concurrency_max is not None:
                specs.append((CONCURRENCY.code, (rule.concurrency_max, rule.concurrency_ttl_ms, 0, 0, 0)))
            specs.append((rule.kind.code, rule.script_params(cost_hint)))
        shadow = [(r.kind.code, r.script_params(cost_hint)) for r in self.shadow]
        argv: tuple | None = None
        if specs:
            try:  # the call's shape checks (count, kinds, five parameters), once
                _, full = multi_rule_argv("-", [Call(f"k{i}", k, p) for i, (k, p) in enumerate(specs)],
                                          slack_ms=0, decision_ttl_ms=0, member="-")
                argv = tuple(full[3:-1])
            except ScriptRejected:
                argv = None
        if len(self.by_cost) >= 1_000:  # cost hints are 1..1000 (the wire type); bounded anyway
            self.by_cost.clear()
        out = self.by_cost[cost_hint] = (specs, shadow, argv)
        return out


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
        self._shapes: BoundedMemo[tuple, Shape] = BoundedMemo(SELECTION_CACHE_MAX)

    def shape(self, tenant: str | None, route_group: str, principal_type: str, has_key: bool) -> Shape:
        k = (tenant, route_group, principal_type, has_key)
        hit = self._shapes.get(k)
        if hit is None:
            shape = Shape.of(select_rules(self.bundle.rules, tenant=tenant, route_group=route_group,
                                          principal_type=principal_type, has_key=has_key), tenant)
            if principal_type != "anonymous":
                edge = every_request_rules(self.bundle.rules, route_group=route_group)
                if edge:
                    shape = shape._replace(edge=Shape.of(edge))
            hit = self._shapes.put(k, shape)
        return hit


_last_memo: BundleMemo | None = None
_other_memo: BundleMemo | None = None


def memo_of(bundle: Bundle) -> BundleMemo:
    """The memo of ``bundle``. Two slots: the snapshot in force and, while a canary is staged, the
    other of the pair a request may be evaluated against (the current and the candidate bundle);
    a third snapshot replaces the older one."""
    global _last_memo, _other_memo
    m = _last_memo
    if m is None or m.bundle is not bundle:
        o = _other_memo
        if o is not None and o.bundle is bundle:
            _other_memo, _last_memo = m, o
            return o
        _other_memo, m = m, BundleMemo(bundle)
        _last_memo = m
    return m


def selected(bundle: Bundle, *, tenant: str | None, route_group: str, principal: Principal) -> list[Rule]:
    return list(memo_of(bundle).shape(tenant, route_group, principal.type, principal.api_key_id is not None).rules)


def build_plan(bundle: Bundle, req: AdmitRequest, keys: KeyBuilder, *, checked: bool = False,
               shape: Shape | None = None) -> Plan:
    """The plan of ``req`` under ``bundle``. ``checked``: ``req`` came out of the strict wire
    decoder (region_agent.models: its request id and route group already match their patterns),
    so they are not matched again; a request built in process (library mode) is checked here.
    ``shape``: the rules to plan (an edge stage's), instead of those the request selects."""
    if not checked:
        check_ids(req.request_id, req.route_group)
    principal = req.principal
    ptype = principal.type
    tenant, addr = check_principal(req.tenant_id, principal)
    api_key_id = principal.api_key_id
    memo = memo_of(bundle)
    if shape is None:
        shape = memo.shape(tenant, req.route_group, ptype, api_key_id is not None)
    cost_hint = req.cost_hint
    specs, shadow_specs, argv_rules = shape.params_for(cost_hint)
    ip_tag = keys.ip_tag(addr, shape.ip_rules) if addr is not None else None
    user_id = principal.id if ptype == "user" else None
    calls: list[Call] = []
    i = 0
    for rule, t in zip(shape.in_script, shape.templates, strict=True):
        if t is not None:
            key = keys.key_from(t, tenant, user_id, api_key_id)
        else:
            key = _key_of(keys, rule, tenant, user_id, api_key_id, req.route_group, ip_tag, addr)
        if rule.concurrency_max is not None:
            calls.append(_new(Call, (KeyBuilder.cc_key(key), *specs[i])))
            i += 1
        calls.append(_new(Call, (key, *specs[i])))
        i += 1
    shadow_calls: list[Call] = _NONE  # type: ignore[assignment]  # the shared empty tuple, never appended to
    if shape.shadow:
        shadow_calls = []
        for rule, t, spec in zip(shape.shadow, shape.shadow_templates, shadow_specs, strict=True):
            if t is not None:
                key = keys.key_from(t, tenant, user_id, api_key_id)
            else:
                key = _key_of(keys, rule, tenant, user_id, api_key_id, req.route_group, ip_tag, addr)
            shadow_calls.append(_new(Call, (key, *spec)))
    spends: list[GlobalSpend] = _NONE  # type: ignore[assignment]  # the shared empty tuple, never appended to
    if shape.fleet:
        spends = [GlobalSpend(rule, memo.pools[rule.pool_id or ""], rule.tokens(cost_hint)) for rule in shape.fleet]
    question = ""
    if shape.decision_ttl_ms > 0:
        decision_key = keys.decision_key(req.request_id, tenant=tenant if ip_tag is None else None, ip_tag=ip_tag)
        question = keys.question(tenant=tenant, principal_type=ptype, principal_id=principal.id,
                                 api_key_id=api_key_id, route_group=req.route_group, cost_hint=cost_hint)
    elif ip_tag is None and shape.unrecorded_dk is not None:
        decision_key = shape.unrecorded_dk
    else:
        decision_key = KeyBuilder.unrecorded_decision_key(tenant=tenant if ip_tag is None else None, ip_tag=ip_tag)
    edge = None
    if shape.edge is not None and req.client_ip is not None:
        edge = edge_plan(bundle, req, keys, shape.edge)
    return Plan(req.request_id, tenant, ptype, shape.enforced, calls, shape.slots, shadow_calls, shape.shadow_slots,
                spends, decision_key, shape.decision_ttl_ms, question, shape.slack_ms, cost_hint, argv_rules,
                shape.has_pool, shape, req, edge)


def edge_plan(bundle: Bundle, req: AdmitRequest, keys: KeyBuilder, edge: Shape) -> Plan:
    """The pre-authentication stage of authenticated ``req``: its ``clientIp`` as an anonymous
    caller, asked by the ``edge`` shape's rules only, at cost 1 (a stage-1 window counts
    requests, not their weight)."""
    anon = AdmitRequest(request_id=req.request_id, principal=Principal(type="anonymous", id=req.client_ip or ""),
                        route_group=req.route_group, method=req.method)
    return build_plan(bundle, anon, keys, checked=True, shape=edge)


_NONE: tuple = ()  # the shared empty sequence of a plan without shadow calls or global spends


def _key_of(keys: KeyBuilder, rule: Rule, tenant: str | None, user_id: str | None, api_key_id: str | None,
            route_group: str, ip_tag: str | None, addr) -> str:
    """A rule's key derived per request (rules without a KeyTemplate: ip rules, and whatever
    must raise the request's ValidationFailed)."""
    if rule.pool_id is not None:
        return keys.tenant_pool_key(tenant or "", rule.pool_id)
    return keys.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=api_key_id, route_group=route_group,
                         ip_tag=ip_tag, addr=addr)


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


__all__ = ["BundleMemo", "Call", "GlobalSpend", "Plan", "Shape", "Slot", "build_plan", "cc_gates", "cc_keys_for_release",
           "check_principal", "memo_of"]
