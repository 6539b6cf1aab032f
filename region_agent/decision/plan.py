"""Turn one admission request and one policy snapshot into the script calls of its decision.

Pure: no I/O, no clock. Its rule slots (:class:`~region_agent.decision.call.Call`) become the script call
(:mod:`region_agent.decision.call`).

:class:`Snapshot` is one accepted bundle with everything the request path derives from it once
(pools and rules by id, the :class:`Shape` per selection, the HTTP field text, the agent's retry
jitter). The policy holder makes one when it accepts a bundle (region_agent.service.policy); every
request reads one snapshot end to end. docs/hot-path.md lists what it memoises.

Identity fields are checked once, where a request enters: the wire decoder's types
(region_agent.models) or :func:`check_request` for a request built in process; from there on
a tenant id is trusted (region_agent.decision.keys derives keys from it without checking it again).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from kernel.algorithms import Role
from kernel.algorithms.concurrency import KIND as CONCURRENCY
from kernel.algorithms.pool import PoolRule
from kernel.algorithms.rule import Params
from kernel.bundle import Bundle, Pool, Rule, every_request_rules, select_rules
from kernel.caches import BoundedMemo
from kernel.errors import ScriptRejected, ValidationFailed
from kernel.ids import REQUEST_ID_RE, ROUTE_RE, TENANT_RE
from kernel.split import divide_all, splits_of

from ..models import AdmitRequest, Principal
from .call import Call, CallText, call_text, multi_rule_argv
from .hot import HotConfig, derive_hot
from .httpmap import HttpAnswers, RetryJitter, admitted_fields
from .keys import KeyBuilder, KeyTemplate, parse_ip
from .negcache import denial_keys
from .outcome import admission_of

# immutable records built per decision: NamedTuples rather than frozen dataclasses; the hot path
# builds them with tuple.__new__ (a NamedTuple's own __new__ is a Python function: a tenth of build_plan)
_new = tuple.__new__


class Slot(NamedTuple):
    rule: Rule
    role: Role


class ApproxSpend(NamedTuple):
    """An approximate rule's key, counted in process (region_agent.decision.approx, kernel/approx.py)."""

    rule: Rule
    key: str


class GlobalSpend(NamedTuple):
    rule: Rule
    pool: Pool
    cost: int  # whole tokens


class Plan(msgspec.Struct):
    request_id: str
    tenant: str | None
    principal_type: str
    rules: list[Rule]  # every selected enforced rule, evaluation order (incl. global pools); shared, read-only
    calls: list[Call] = msgspec.field(default_factory=list)
    slots: list[Slot] = msgspec.field(default_factory=list)  # shared with the plan's Shape: read-only
    shadow_calls: Sequence[Call] = ()  # read-only
    shadow_slots: list[Slot] = msgspec.field(default_factory=list)  # shared with the plan's Shape: read-only
    global_spends: Sequence[GlobalSpend] = ()  # read-only
    decision_key: str = ""
    decision_ttl_ms: int = 0
    question: str = ""  # what the decision record answers (keys.KeyBuilder.question); '' without a record
    slack_ms: int = 0
    cost_hint: int = 1
    # ARGV of ``multi_rule.lua`` between the member and the question (every slot's kind and five
    # parameters), checked once per Shape and cost (region_agent.decision.call.multi_rule_call); None: the
    # calls are built and checked per request
    argv_rules: tuple[object, ...] | None = None
    has_pool: bool = False  # a slot spends a tenant pool balance (Role.POOL)
    shape: Shape | None = None  # what the plan was built from (shared, read-only)
    request: AdmitRequest | None = None  # the question (the sampled decision log reads the principal from it)
    # the pre-authentication stage of an authenticated request (ip rules marked everyRequest,
    # keyed by its clientIp): decided first, in its own call (another hash tag than the tenant's)
    edge: Plan | None = None
    approx: Sequence[ApproxSpend] = ()  # approximate rules: counted in process, not in the script
    # what a held denial of this question is found by (region_agent.decision.denials): the whole
    # call's slots, then each slot's (key, params); shared, read-only
    denial_keys: Sequence[tuple[object, ...]] = ()
    # the tenant call's parts every asking of a remembered question shares (None: built per request)
    text: CallText | None = None

    @property
    def anonymous(self) -> bool:
        return self.principal_type == "anonymous"

    @property
    def rule_keys(self) -> dict[str, str]:
        """Rule id -> its state key (in-process only: the local fallback's buckets)."""
        return {slot.rule.id: call.key for slot, call in zip(self.slots, self.calls, strict=False)
                if slot.role is not Role.CC}


def check_tenant(tenant: object) -> str:
    """A tenant id from outside the wire types (library mode): ``[a-z0-9-]{1,32}`` or ValidationFailed."""
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ValidationFailed("tenantId must match [a-z0-9-]{1,32}", errors=["tenantId: invalid"])
    return tenant


def check_route(route: object) -> str:
    if not isinstance(route, str) or not ROUTE_RE.fullmatch(route):
        raise ValidationFailed("routeGroup must match [a-z0-9_-]{1,32}", errors=["routeGroup: invalid"])
    return route


def check_request(request_id: object, route_group: object, tenant: object) -> None:
    """The wire types' checks of the identity fields, once, for a request built in process
    (library mode, the replay): what the strict decoder already checked for a decoded one."""
    if not isinstance(request_id, str) or not REQUEST_ID_RE.match(request_id):
        raise ValidationFailed("requestId must match [A-Za-z0-9._:-]{8,128}", errors=["requestId: invalid"])
    check_route(route_group)
    if tenant is not None:
        check_tenant(tenant)


def check_principal(req_tenant: str | None, principal: Principal
                    ) -> tuple[str | None, ipaddress.IPv4Address | ipaddress.IPv6Address | None]:
    """The identity checks no wire type can make (the tenant id itself was checked where the
    request entered): (tenant, the anonymous caller's address or None)."""
    if principal.type == "anonymous":
        return req_tenant, parse_ip(principal.id)
    if req_tenant is None:
        raise ValidationFailed("tenantId is required for an authenticated principal",
                               errors=["tenantId: required unless principal.type is anonymous"])
    return req_tenant, None


# per cost: (kind, params) of every slot, of every shadow slot, and the tenant call's checked ARGV
# between member and question (None: built and checked per request)
SlotParams = tuple[list[tuple[str, Params]], list[tuple[str, Params]], tuple[object, ...] | None]

MAX_TENANT_LABELS = 50  # tenants a bundle names that metrics label by name (region_agent.decision.telemetry)


def named_tenants(bundle: Bundle) -> frozenset[str]:
    """The tenants the bundle's rules name, the first ``MAX_TENANT_LABELS`` in sorted order."""
    return frozenset(sorted({r.tenant for r in bundle.rules if r.tenant})[:MAX_TENANT_LABELS])


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
    fleet: list[PoolRule]  # enforced fleet-wide pool rules (spent from in-process chunks)
    has_pool: bool  # a slot is a tenant pool rule (Role.POOL)
    unrecorded_dk: str | None  # KEYS[1] without a decision record for the tenant tag (None: per request)
    by_cost: dict[int, SlotParams]
    # an authenticated shape's pre-authentication stage: the shape of the ip rules marked
    # everyRequest on its route (None: there are none, or the shape is anonymous already)
    edge: Shape | None = None
    # the sub-bucket of a split tenant (kernel/split.py) whose tag the keys carry (None: not split)
    sub: int | None = None
    approx: tuple[Rule, ...] = ()  # enforced approximate rules (counted in process, kernel/approx.py)
    approx_templates: tuple[KeyTemplate | None, ...] = ()
    # the parts of a store admission's record (region_agent.decision.record.admitted_reply); None when no
    # slot reports for the decision (the engine's general path answers)
    admitted: Admitted | None = None
    # how the shape's key sets are served from chunks once hot (region_agent.decision.hot; None: never)
    hot: HotConfig | None = None

    @classmethod
    def of(cls, rules: list[Rule], tenant: str | None = None, sub: int | None = None) -> Shape:
        enforced = [r for r in rules if not r.shadow]
        approx = tuple(r for r in enforced if r.approximate is not None)
        in_script = [r for r in enforced if not r.fleet_wide and r.approximate is None]
        shadow = [r for r in rules if r.shadow and not r.fleet_wide]
        slots: list[Slot] = []
        for rule in in_script:
            if rule.concurrency_max is not None:
                slots.append(Slot(rule, Role.CC))
            slots.append(Slot(rule, rule.role))
        dk = KeyBuilder.unrecorded_decision_key(tenant=tenant, sub=sub) if tenant is not None else None
        return cls(rules=rules, enforced=enforced, in_script=in_script, shadow=shadow,
                   ip_rules=[r for r in rules if r.scope == "ip"],
                   slack_ms=max((r.ttl_slack_ms for r in in_script), default=0),
                   decision_ttl_ms=(max(r.decision_ttl_ms for r in in_script)
                                    if any(r.idempotent for r in in_script) else 0),
                   templates=tuple(KeyBuilder.template(r, tenant, sub) for r in in_script),
                   shadow_templates=tuple(KeyBuilder.template(r, tenant, sub) for r in shadow),
                   slots=slots, shadow_slots=[Slot(r, r.role) for r in shadow],
                   fleet=[r for r in enforced if isinstance(r, PoolRule) and r.fleet_wide],
                   has_pool=any(s.role is Role.POOL for s in slots), unrecorded_dk=dk, by_cost={},
                   sub=sub, approx=approx, approx_templates=tuple(KeyBuilder.template(r, tenant, sub) for r in approx))

    def params_for(self, cost_hint: int) -> SlotParams:
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
        argv: tuple[object, ...] | None = None
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


class Admitted(NamedTuple):
    """What a store admission's record takes from its plan's shape (region_agent.decision.record): the
    reporting slot, its rule and limit, and the count-free header parts (RateLimit-Policy,
    RateLimit prefix; None: no headers)."""

    slot: int
    rule: Rule
    limit: int
    fields: tuple[str, str] | None


class Snapshot:
    """One accepted policy bundle and what the request path derives from it once: pools and
    rules by id, the :class:`Shape` per (tenant, route group, principal type, has key), the HTTP
    answers' field text and the agent's retry jitter (:class:`~region_agent.decision.httpmap.HttpAnswers`).
    A bundle is immutable, so these stay valid for the snapshot's lifetime; the shapes are a
    bounded memo (``SELECTION_CACHE_MAX``; only checked tenants and routes reach it). Made by
    the policy holder when it accepts a bundle (region_agent.service.policy) and dropped with it: no
    state of one agent is shared with another in the same process."""

    __slots__ = ("_shapes", "bundle", "http", "keyed", "keyed_by", "named_tenants", "per_unit", "pools", "rules_by_id",
                 "seen", "splits")

    def __init__(self, bundle: Bundle, jitter: RetryJitter | None = None):
        self.bundle = bundle
        self.pools: dict[str, Pool] = {p.id: p for p in bundle.pools}
        self.rules_by_id: dict[str, Rule] = {r.id: r for r in bundle.rules}
        self.splits: dict[str, int] = splits_of(bundle.tenant_splits)  # tenant -> sub-buckets (kernel/split.py)
        self.named_tenants = named_tenants(bundle)  # the tenants metrics label by name
        self.http = HttpAnswers(jitter)
        # rule id -> Envoy's (requests_per_unit, unit) or None (region_agent.gateways.answer.per_unit)
        self.per_unit: dict[str, tuple[int, str] | None] = {}
        self._shapes: BoundedMemo[tuple[str | None, str, str, bool, int | None], Shape] = BoundedMemo(
            SELECTION_CACHE_MAX)
        # a question's plan without its request id (:class:`Keyed`), per (tenant, route group,
        # principal type, id and API key, cost), for the first key builder that asks (the agent has
        # one; another one's plans are built per request): a busy principal's plan is derived once.
        # A question is remembered the second time it is asked within ``SEEN_MAX`` others (``seen``):
        # a question asked once costs no memo entry, and the memo holds the questions that repeat
        self.keyed: BoundedMemo[Question, Keyed] = BoundedMemo(KEYED_CACHE_MAX)
        self.seen: BoundedMemo[Question, bool] = BoundedMemo(SEEN_MAX)
        self.keyed_by: KeyBuilder | None = None

    def __repr__(self) -> str:
        return f"Snapshot(bundle {self.bundle.bundle_version})"

    def shape(self, tenant: str | None, route_group: str, principal_type: str, has_key: bool,
              sub: int | None = None) -> Shape:
        """``sub``: the sub-bucket of a split tenant (its route and tenant rules divided)."""
        k = (tenant, route_group, principal_type, has_key, sub)
        hit = self._shapes.get(k)
        if hit is None:
            rules = self.bundle.rules
            selected = select_rules(rules, tenant=tenant, route_group=route_group, principal_type=principal_type,
                                    has_key=has_key)
            if sub is not None:
                selected = divide_all(selected, self.splits[tenant or ""], sub)
            shape = self._admitting(Shape.of(selected, tenant, sub), anonymous=principal_type == "anonymous")
            shape = shape._replace(hot=derive_hot(shape))
            if principal_type != "anonymous":
                edge = every_request_rules(rules, route_group=route_group)
                if edge:
                    shape = shape._replace(edge=self._admitting(Shape.of(edge), anonymous=True))
            hit = self._shapes.put(k, shape)
        return hit

    def _admitting(self, shape: Shape, *, anonymous: bool) -> Shape:
        adm = admission_of(shape.enforced, shape.slots, self.pools)
        if adm is None:
            return shape
        return shape._replace(admitted=Admitted(adm.slot, adm.rule, adm.limit,
                                                admitted_fields(self.http, adm.rule, adm.limit, anonymous=anonymous)))

    def selected(self, *, tenant: str | None, route_group: str, principal: Principal) -> list[Rule]:
        return list(self.shape(tenant, route_group, principal.type, principal.api_key_id is not None).rules)


KEYED_CACHE_MAX = 20_000  # questions per snapshot whose plan is kept (a few hundred bytes each)
SEEN_MAX = 50_000  # questions asked once, remembered as asked (a tuple of strings each)
# (tenant, route group, principal type, principal id, API key id, cost): a tuple, never a joined
# string (principal and key ids are free text: a separator inside one must not make two questions one)
Question = tuple[str | None, str, str, str, str | None, int]


class Keyed(NamedTuple):
    """Everything of a plan that follows from the question alone (tenant, route group, principal,
    API key, cost) under one snapshot and key builder: the shape, the calls with their keys, the
    shadow calls, global spends and approximate keys, and what the decision key needs. Only the
    request id (and with it a recorded decision's key) is per request. Shared, read-only."""

    shape: Shape
    tenant: str | None
    ip_tag: str | None
    calls: list[Call]
    shadow_calls: Sequence[Call]
    spends: Sequence[GlobalSpend]
    approx: Sequence[ApproxSpend]
    argv_rules: tuple[object, ...] | None
    unrecorded_dk: str  # KEYS[1] when the shape stores no decision record ('' when it does)
    question: str  # what a decision record answers ('' when the shape stores none)
    denial_keys: tuple[tuple[object, ...], ...]  # Plan.denial_keys (() until remembered: Denials builds them)
    text: CallText | None  # Plan.text (None until remembered)


def build_plan(snap: Snapshot, req: AdmitRequest, keys: KeyBuilder, *, checked: bool = False,
               shape: Shape | None = None) -> Plan:
    """The plan of ``req`` under snapshot ``snap``. ``checked``: ``req`` came out of the strict
    wire decoder (region_agent.models: its request id, route group and tenant id already match
    their patterns), so they are not matched again; a request built in process (library mode) is
    checked here, once. ``shape``: the rules to plan (an edge stage's), instead of those the
    request selects.

    The part of the plan that does not depend on the request id (:class:`Keyed`) is remembered
    per question in the snapshot from the second time it is asked (``Snapshot.keyed``, bounded):
    a policy reload makes a new snapshot, so a remembered plan never outlives the bundle it was
    built from."""
    if not checked:
        check_request(req.request_id, req.route_group, req.tenant_id)
    principal = req.principal
    if shape is not None:
        kd = _keyed(snap, req, keys, shape)
    elif keys is snap.keyed_by or snap.keyed_by is None:
        snap.keyed_by = keys
        q = (req.tenant_id, req.route_group, principal.type, principal.id, principal.api_key_id, req.cost_hint)
        kd = snap.keyed.get(q)  # type: ignore[assignment]  # (None: not remembered)
        if kd is None:  # (a question the keys refuse raises in _keyed, every time: nothing is remembered)
            kd = _keyed(snap, req, keys, None)
            seen = snap.seen
            if q in seen:  # asked before: remembered from now on, with the negative cache's lookup keys
                kd = snap.keyed.put(q, _remembered(kd))
            else:  # (BoundedMemo.put inline: most questions of a long tail are asked once)
                if len(seen) >= SEEN_MAX:
                    seen.clear()
                seen[q] = True
    else:
        kd = _keyed(snap, req, keys, None)
    shape, tenant, ip_tag, calls, shadow_calls, spends, approx, argv_rules, decision_key, question, dks, text = kd
    if not decision_key:  # a recorded decision: its key is the request id's
        decision_key = keys.decision_key(req.request_id, tenant=tenant if ip_tag is None else None, ip_tag=ip_tag,
                                         sub=shape.sub)
    edge = None
    if shape.edge is not None and req.client_ip is not None:
        edge = edge_plan(snap, req, keys, shape.edge)
    return Plan(req.request_id, tenant, principal.type, shape.enforced, calls, shape.slots, shadow_calls,
                shape.shadow_slots, spends, decision_key, shape.decision_ttl_ms, question, shape.slack_ms,
                req.cost_hint, argv_rules, shape.has_pool, shape, req, edge, approx, dks, text)


def _remembered(kd: Keyed) -> Keyed:
    """``kd`` as a remembered question keeps it: with the negative cache's lookup keys and its
    tenant call's :class:`~region_agent.decision.call.CallText` (each asking then builds only
    what is its own: the request id, a recorded decision's key)."""
    shape = kd.shape
    return kd._replace(denial_keys=denial_keys(kd.calls), text=call_text(
        kd.calls, kd.argv_rules, decision_key=kd.unrecorded_dk, slack_ms=shape.slack_ms,
        decision_ttl_ms=shape.decision_ttl_ms, question=kd.question))


def _keyed(snap: Snapshot, req: AdmitRequest, keys: KeyBuilder, shape: Shape | None) -> Keyed:
    """:class:`Keyed` of ``req``'s question (identity fields checked: :func:`build_plan`)."""
    principal = req.principal
    ptype = principal.type
    tenant, addr = check_principal(req.tenant_id, principal)
    api_key_id = principal.api_key_id
    if shape is None:
        sub = None
        if snap.splits and addr is None and tenant in snap.splits:
            sub = keys.sub_bucket(tenant, ptype, principal.id, snap.splits[tenant])
        shape = snap.shape(tenant, req.route_group, ptype, api_key_id is not None, sub)
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
            key = _key_of(keys, rule, tenant, user_id, api_key_id, req.route_group, ip_tag, addr, shape.sub)
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
                key = _key_of(keys, rule, tenant, user_id, api_key_id, req.route_group, ip_tag, addr, shape.sub)
            shadow_calls.append(_new(Call, (key, *spec)))
    spends: list[GlobalSpend] = _NONE  # type: ignore[assignment]  # the shared empty tuple, never appended to
    if shape.fleet:
        pools = snap.pools
        spends = [GlobalSpend(rule, pools[rule.pool_id or ""], rule.tokens(cost_hint)) for rule in shape.fleet]
    approx: list[ApproxSpend] = _NONE  # type: ignore[assignment]  # the shared empty tuple, never appended to
    if shape.approx:
        approx = []
        for rule, t in zip(shape.approx, shape.approx_templates, strict=True):
            if t is not None:
                key = keys.key_from(t, tenant, user_id, api_key_id)
            else:
                key = _key_of(keys, rule, tenant, user_id, api_key_id, req.route_group, ip_tag, addr, shape.sub)
            approx.append(ApproxSpend(rule, key + ":approx"))
    question = unrecorded = ""
    if shape.decision_ttl_ms > 0:
        if ip_tag is None:
            KeyBuilder.tenant_tag(tenant, shape.sub)  # a recorded decision's key needs the tenant: raises here
        question = keys.question(tenant=tenant, principal_type=ptype, principal_id=principal.id,
                                 api_key_id=api_key_id, route_group=req.route_group, cost_hint=cost_hint)
    elif ip_tag is None and shape.unrecorded_dk is not None:
        unrecorded = shape.unrecorded_dk
    else:
        unrecorded = KeyBuilder.unrecorded_decision_key(tenant=tenant if ip_tag is None else None, ip_tag=ip_tag,
                                                        sub=shape.sub)
    return _new(Keyed, (shape, tenant, ip_tag, calls, shadow_calls, spends, approx, argv_rules, unrecorded, question,
                        (), None))  # (the lookup keys and call text are built when the question is remembered: build_plan)


def edge_plan(snap: Snapshot, req: AdmitRequest, keys: KeyBuilder, edge: Shape) -> Plan:
    """The pre-authentication stage of authenticated ``req``: its ``clientIp`` as an anonymous
    caller, asked by the ``edge`` shape's rules only, at cost 1 (a stage-1 window counts
    requests, not their weight)."""
    anon = AdmitRequest(request_id=req.request_id, principal=Principal(type="anonymous", id=req.client_ip or ""),
                        route_group=req.route_group, method=req.method)
    return build_plan(snap, anon, keys, checked=True, shape=edge)


_NONE: tuple[()] = ()  # the shared empty sequence of a plan without shadow calls or global spends


def _key_of(keys: KeyBuilder, rule: Rule, tenant: str | None, user_id: str | None, api_key_id: str | None,
            route_group: str, ip_tag: str | None, addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None,
            sub: int | None = None) -> str:
    """A rule's key derived per request (rules without a KeyTemplate: ip rules, and whatever
    must raise the request's ValidationFailed)."""
    if rule.pool_id is not None:
        return keys.tenant_pool_key(tenant or "", rule.pool_id)
    return keys.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=api_key_id, route_group=route_group,
                         ip_tag=ip_tag, addr=addr, sub=sub)


def cc_gates(snap: Snapshot, *, request_tenant: str | None, principal: Principal, route_group: str,
             keys: KeyBuilder) -> list[tuple[str, Rule]]:
    """(key, rule) of every concurrency gate an admission with these attributes (decoded: their
    identity fields checked) would have acquired."""
    tenant, addr = check_principal(request_tenant, principal)
    out: list[tuple[str, Rule]] = []
    if addr is not None:
        return out  # ip rules carry no concurrency gates (bundle validation)
    user_id = principal.id if principal.type == "user" else None
    sub = None
    if tenant in snap.splits:  # the sub-bucket the admission's keys carried (kernel/split.py)
        sub = keys.sub_bucket(tenant, principal.type, principal.id, snap.splits[tenant])
    for rule in snap.shape(tenant, route_group, principal.type, principal.api_key_id is not None, sub).rules:
        if rule.shadow or rule.concurrency_max is None:
            continue
        key = keys.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=principal.api_key_id,
                            route_group=route_group, sub=sub)
        out.append((KeyBuilder.cc_key(key), rule))
    return out


def cc_keys_for_release(snap: Snapshot, *, request_tenant: str | None, principal: Principal,
                        route_group: str, keys: KeyBuilder) -> list[str]:
    """The concurrency gates an admission with these attributes would have acquired."""
    return [key for key, _ in cc_gates(snap, request_tenant=request_tenant, principal=principal,
                                       route_group=route_group, keys=keys)]


__all__ = ["Admitted", "ApproxSpend", "Call", "GlobalSpend", "Keyed", "Plan", "Shape", "Slot", "Snapshot", "build_plan",
           "cc_gates", "cc_keys_for_release", "check_principal", "check_request"]
