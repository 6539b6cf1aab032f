"""Wire types of the region agent (camelCase JSON, msgspec Structs)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from kernel.ids import (
    METHOD_RE,
    REQUEST_ID_RE,
    ROUTE_RE,
    TENANT_RE,
    Method,
    RequestId,
    RouteGroup,
    TenantId,
    is_id_text,
)

ID_MAX_CHARS = 256  # a principal's or API key's id, at most
PrincipalId = Annotated[str, Meta(min_length=1, max_length=ID_MAX_CHARS)]  # and identity text: Principal
ApiKeyId = Annotated[str, Meta(min_length=1, max_length=ID_MAX_CHARS)]
CostHint = Annotated[int, Meta(ge=1, le=1000)]

MAX_BODY_BYTES = 16 * 1024
MAX_BATCH_BODY_BYTES = 1024 * 1024
MAX_BATCH_ITEMS = 1000


class Principal(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    type: Literal["user", "service", "anonymous"]
    id: PrincipalId
    api_key_id: ApiKeyId | None = None

    def __post_init__(self) -> None:
        """A user's or service's id and an API key id are identity text (``kernel.ids.ID_TEXT``), at
        every door: a question asked with " admin" is refused (a ValidationError where it is decoded),
        never charged as a principal of its own while a backend serves admin. An anonymous principal's
        id is an address, parsed where it is used. The length is checked here as well as by the wire
        types for a principal built in process (library mode), which no decoder sees."""
        if (self.type != "anonymous" and not is_id_text(self.id)) or (
                self.api_key_id is not None and not is_id_text(self.api_key_id)):
            raise ValueError("a principal or API key id must be identity text: no control character, "
                             "no space or tab at either end")
        if len(self.id) > ID_MAX_CHARS or (self.api_key_id is not None and len(self.api_key_id) > ID_MAX_CHARS):
            raise ValueError(f"a principal or API key id has at most {ID_MAX_CHARS} characters")


class AdmitRequest(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    request_id: RequestId
    principal: Principal
    route_group: RouteGroup
    method: Method = "GET"
    tenant_id: TenantId | None = None
    cost_hint: CostHint = 1
    # the bundle version the gateway evaluated against; on the wire ``policyEpoch`` (docs/glossary.md)
    bundle_version: Annotated[int, Meta(ge=0, le=2**53)] | None = field(default=None, name="policyEpoch")
    auth_failed: bool = False  # the gateway reports a failed authentication: counts against the IP only
    client_ip: Annotated[str, Meta(min_length=2, max_length=64)] | None = None  # required with authFailed


class AdmitText(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """:class:`AdmitRequest` without the identity patterns of its fields (the same fields, names,
    order, defaults and every other constraint; tests/unit/region_agent/service/test_fastpath_decode.py
    compares the two types). msgspec searches each field's pattern, about 3,000 instructions a field;
    :func:`admit_of_text` checks these fields itself, for the HTTP door's decode
    (region_agent.service.fastpath) and the RLS door's questions (region_agent.gateways.mapping)."""

    request_id: str
    principal: Principal
    route_group: str
    method: str = "GET"
    tenant_id: str | None = None
    cost_hint: CostHint = 1
    bundle_version: Annotated[int, Meta(ge=0, le=2**53)] | None = field(default=None, name="policyEpoch")
    auth_failed: bool = False
    client_ip: Annotated[str, Meta(min_length=2, max_length=64)] | None = None


_search_request_id = REQUEST_ID_RE.search
# the route groups, tenant ids and methods their patterns took (few values, asked again and again): a
# value seen before is a set lookup; each set starts again empty when full
LEARNED_MAX = 4_096
_routes: set[str] = set()
_tenants: set[str] = set()
_methods: set[str] = set()


def _learned(value: str, known: set[str], pattern: re.Pattern[str]) -> bool:
    """Whether ``pattern`` finds ``value`` (what msgspec's ``Meta(pattern=...)`` asks), remembered in
    ``known`` when it does."""
    if pattern.search(value) is None:
        return False
    if len(known) >= LEARNED_MAX:
        known.clear()
    known.add(value)
    return True


def admit_of_text(t: AdmitText) -> AdmitRequest | None:
    """The :class:`AdmitRequest` of ``t`` when its four patterned fields match their patterns
    (``kernel.ids``: the request id always, the route group, tenant and method only when they are
    not among the values a pattern already took), else None: the caller then decodes or converts
    strictly into :class:`AdmitRequest`, which refuses it with msgspec's own reason."""
    rid, route, method, tenant = t.request_id, t.route_group, t.method, t.tenant_id
    if not ((route in _routes or _learned(route, _routes, ROUTE_RE))
            and (method in _methods or _learned(method, _methods, METHOD_RE))
            and (tenant is None or tenant in _tenants or _learned(tenant, _tenants, TENANT_RE))
            and _search_request_id(rid) is not None):
        return None
    return AdmitRequest(rid, t.principal, route, method, tenant, t.cost_hint, t.bundle_version, t.auth_failed,
                        t.client_ip)


class AdmitBatch(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    requests: Annotated[list[AdmitRequest], Meta(max_length=MAX_BATCH_ITEMS)]


def keys_shown(req: AdmitRequest) -> int:
    """A lower bound of the JSON keys a decoded ``req`` had: its required fields and those whose
    value differs from the default (kernel.jsonbody.repeats_keys). A field added later only makes
    the bound lower (the exact check then runs), never wrong."""
    p = req.principal
    return (5 + (p.api_key_id is not None) + (req.method != "GET") + (req.tenant_id is not None)
            + (req.cost_hint != 1) + (req.bundle_version is not None) + req.auth_failed + (req.client_ip is not None))


class ReleaseRequest(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    request_id: RequestId
    principal: Principal
    route_group: RouteGroup
    tenant_id: TenantId | None = None


class DeniedScope(StrEnum):
    """Which limit denied a decision (the decision record's ``deniedScope``; JSON: the value).

    The rule scopes of the bundle (kernel.algorithms.rule.Scope) plus ``concurrency`` (a
    concurrency gate). The OpenAPI document shows it inline, as the string enum it always was
    (kernel.openapi_enums)."""

    USER = "user"
    KEY = "key"
    ROUTE = "route"
    TENANT = "tenant"
    GLOBAL = "global"
    CONCURRENCY = "concurrency"
    IP = "ip"


class Reason(StrEnum):
    """Why a decision did not admit (the decision record's ``reason``; JSON: the value)."""

    RATE_EXCEEDED = "RATE_EXCEEDED"
    CONCURRENCY_EXCEEDED = "CONCURRENCY_EXCEEDED"
    LIMITER_UNAVAILABLE = "LIMITER_UNAVAILABLE"
    POLICY_ERROR = "POLICY_ERROR"
    POLICY_STALE = "POLICY_STALE"
    REQUEST_ID_CONFLICT = "REQUEST_ID_CONFLICT"  # a batch item whose requestId was decided for another question
    OVERLOADED = "OVERLOADED"  # shed: this agent saturated while its store answered (503, retriable)


class DecisionSource(StrEnum):
    """Which layer made a decision (the record's ``source``; the ``source`` label of
    ``leasehold_agent_decisions_total``; ``decision.source`` on its trace span): so an incident
    review does not take every 429 or 503 for the shared store's answer. Bounded values."""

    SCRIPT = "script"  # the tenant's Redis script on its shard (a 409 conflict included)
    NEGATIVE_CACHE = "negative_cache"  # a denial held in this agent (no store call)
    CHUNK = "chunk"  # an in-process chunk: a fleet-wide pool's, or a hot key set's (no store call)
    LOCAL_FALLBACK = "local_fallback"  # the store was unreachable: the rule's local allowance
    POOL_FALLBACK = "pool_fallback"  # the allocator was unreachable: the pool's fallback allowance
    FAIL_OPEN = "fail_open"  # the store was unreachable: the rule fails open
    FAIL_CLOSED = "fail_closed"  # the store or allocator was unreachable: the rule fails closed (503)
    OVERLOAD = "overload"  # shed: this agent was saturated (503 OVERLOADED)
    POLICY = "policy"  # the bundle alone: no rule applies, or the snapshot is past maxAgeMs
    PREAUTH = "preauth"  # the pre-authentication new-keys-per-source cap
    APPROXIMATE = "approximate"  # an approximate rule's in-process counter (kernel/approx.py; no store call)


class Decision(Struct, rename="camel", omit_defaults=False):
    """The decision record plus the HTTP response the gateway should send."""

    allowed: bool
    decision_id: str
    rule_id: str | None = field(name="policyId")  # the deciding rule (docs/glossary.md)
    bundle_version: int = field(name="policyVersion")  # the bundle version decided with (docs/glossary.md)
    denied_scope: DeniedScope | None = None
    reason: Reason | None = None
    limit: int | None = None
    remaining: int | None = None
    retry_after_ms: int = 0
    fallback: bool = False
    retry_jitter_ms: int = 0  # upward jitter to add to retryAfterMs (I5; region_agent/decision/httpmap.py)
    http_status: int = 200
    headers: dict[str, str] = {}
    problem: dict[str, Any] | None = None
    source: DecisionSource = DecisionSource.SCRIPT  # which layer decided (DecisionSource)


class BatchDecisions(Struct, rename="camel"):
    decisions: list[Decision]


class ReleaseResult(Struct, rename="camel"):
    request_id: str
    released: int  # gates whose live slot this call freed (0: never taken, already released, or expired)
    gates: int  # concurrency gates the request was evaluated against


RenewRequest = ReleaseRequest  # the same question: which request's concurrency slots


class RenewResult(Struct, rename="camel"):
    request_id: str
    renewed: int  # gates whose slot was live and now lasts concurrencyTtlMs from now
    gates: int  # concurrency gates the request was evaluated against (renewed < gates: a slot is gone)


class PolicyInfo(Struct, rename="camel"):
    bundle_version: int
    checksum: str
    published_at: str
    rule_ids: list[str]
    pool_ids: list[str]
