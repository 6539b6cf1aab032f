"""A gateway's own words as Leasehold's question. Pure: no I/O, no protobuf, no clock.

Two front doors ask the same question as ``POST /v1/admit`` (an :class:`AdmitRequest`):

* **Envoy's rate limit service** (RLS v3): each *descriptor* of a ``RateLimitRequest`` is one
  question. Its entries are ``(key, value)`` pairs; :class:`Names` says which descriptor key
  carries which field of the question (agent settings ``--rls-keys``).
* **HTTP forward auth** (``/v1/authz``: Envoy ext_authz, nginx auth_request, Traefik
  ForwardAuth): the question is read from request headers, named by ``--authz-headers``.

Fields of the question (``FIELDS``): ``tenant``, ``user`` or ``service`` (the authenticated
principal; at most one), ``api_key``, ``route_group``, ``client_ip`` (the caller's address: an
*anonymous* question — pre-auth stage, P-ANON — when no principal is given), ``request_id``,
``method`` and ``auth_failed`` (``true``: the gateway's authentication failed; evaluated as
an anonymous request from ``client_ip``, as ``authFailed`` on ``/v1/admit``). With a principal,
``client_ip`` is the question's ``clientIp``: the address window of every request (ip rules
marked ``everyRequest``) is spent in the same decision. The cost is the
RLS ``hits_addend`` (per descriptor, else per request; 0/unset = 1) or the ``cost`` header.

Every question meets the same schema as a ``/v1/admit`` body, so the identity patterns are
those of the JSON API: a valid one is built directly and checked field by field (``_direct``),
anything else is converted strictly with msgspec, which refuses it. Anything that is not a well-formed question
raises :class:`BadQuestion` with a stable ``reason`` (a bounded metric label).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from kernel.errors import ValidationFailed
from kernel.ids import ROUTE_RE

from ..models import ID_MAX_CHARS, AdmitRequest, AdmitText, Principal, admit_of_text

FIELDS = ("tenant", "user", "service", "api_key", "route_group", "client_ip", "request_id", "method",
          "auth_failed")
AUTHZ_ONLY = ("cost", "uri", "deny_status", "token")  # forward-auth headers beyond the question

RLS_DEFAULT_KEYS: dict[str, str] = {
    "tenant": "tenant", "user": "user", "service": "service", "api_key": "api_key",
    "route_group": "route_group", "client_ip": "remote_address",  # Envoy's remote_address action
    "request_id": "request_id", "method": "method", "auth_failed": "auth_failed",
}
AUTHZ_DEFAULT_HEADERS: dict[str, str] = {
    "tenant": "x-tenant-id", "user": "x-user-id", "service": "x-service-id", "api_key": "x-api-key-id",
    "route_group": "x-route-group", "client_ip": "x-real-ip", "request_id": "x-request-id",
    "method": "x-forwarded-method", "auth_failed": "x-leasehold-auth-failed",
    "cost": "x-leasehold-cost",  # request cost (costHint), default 1
    "uri": "x-forwarded-uri",  # original URI for the route-prefix map (Traefik sends it; nginx config sets it)
    "deny_status": "x-leasehold-deny-status",  # 401|403: answer denials with it (nginx auth_request)
    "token": "x-leasehold-authorization",  # "Bearer <gateway token>" when Authorization is the client's
}
MAX_COST = 1000  # AdmitRequest.costHint
DESCRIPTOR_KEY_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
HEADER_RE = re.compile(r"[a-z0-9-]{1,64}")
PREFIX_RE = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]{0,255}")
_convert = msgspec.convert
_replace = msgspec.structs.replace


class BadQuestion(ValidationFailed):
    """Not a well-formed question. ``reason`` is a stable, bounded label (metrics)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail, errors=[f"{reason}: {detail}"])
        self.reason = reason


# ---------------------------------------------------------------------------------- settings
def parse_names(items: Iterable[str], defaults: Mapping[str, str], name_re: re.Pattern[str],
                what: str, *, lower: bool = False) -> dict[str, str]:
    """``field=name`` overrides on top of ``defaults``; raises ValueError (a settings error)
    for an unknown field, a malformed name or two fields sharing one name."""
    names = dict(defaults)
    for raw in items:
        field, sep, name = raw.partition("=")
        field, name = field.strip(), name.strip()
        if lower:
            name = name.lower()
        if not sep or field not in defaults:
            raise ValueError(f"{what}: {raw!r} is not <field>=<name> with field one of {', '.join(defaults)}")
        if not name_re.fullmatch(name):
            raise ValueError(f"{what}: name {name!r} for {field} must match {name_re.pattern}")
        names[field] = name
    seen: dict[str, str] = {}
    for field, name in names.items():
        if name in seen:
            raise ValueError(f"{what}: {seen[name]} and {field} both use {name!r}")
        seen[name] = field
    return names


def parse_route_prefixes(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``/path/prefix=route_group`` entries, longest prefix first; raises ValueError."""
    out: dict[str, str] = {}
    for raw in items:
        prefix, sep, group = raw.rpartition("=")
        prefix, group = prefix.strip(), group.strip()
        if not sep or not PREFIX_RE.fullmatch(prefix) or not ROUTE_RE.match(group):
            raise ValueError(f"authz route prefix {raw!r} must be /<path prefix>=<route group [a-z0-9_-]{{1,32}}>")
        if prefix in out:
            raise ValueError(f"authz route prefix {prefix!r} is given twice")
        out[prefix] = group
    return tuple(sorted(out.items(), key=lambda kv: -len(kv[0])))


@dataclass(frozen=True, slots=True)
class Names:
    """Where a gateway puts each field: RLS descriptor keys and forward-auth header names."""

    rls_domain: str
    rls_keys: dict[str, str]  # field -> descriptor key
    rls_fields: dict[str, str]  # descriptor key -> field
    rls_max_descriptors: int
    headers: dict[str, str]  # field -> lower-case header name
    route_prefixes: tuple[tuple[str, str], ...]

    @classmethod
    def build(cls, *, rls_domain: str = "leasehold", rls_keys: Iterable[str] = (),
              rls_max_descriptors: int = 8, authz_headers: Iterable[str] = (),
              authz_route_prefixes: Iterable[str] = ()) -> Names:
        keys = parse_names(rls_keys, RLS_DEFAULT_KEYS, DESCRIPTOR_KEY_RE, "rls key")
        headers = parse_names(authz_headers, AUTHZ_DEFAULT_HEADERS, HEADER_RE, "authz header", lower=True)
        return cls(rls_domain=rls_domain, rls_keys=keys, rls_fields={v: k for k, v in keys.items()},
                   rls_max_descriptors=rls_max_descriptors, headers=headers,
                   route_prefixes=parse_route_prefixes(authz_route_prefixes))

    @classmethod
    def from_settings(cls, s) -> Names:
        return cls.build(rls_domain=s.rls_domain, rls_keys=s.rls_keys, rls_max_descriptors=s.rls_max_descriptors,
                         authz_headers=s.authz_headers, authz_route_prefixes=s.authz_route_prefixes)


# ---------------------------------------------------------------------------------- the question
_ID_HEX = 20  # 80 random bits per minted id
_ids_per_draw = 256
_pool: list[str] = []
os.register_at_fork(after_in_child=_pool.clear)  # a forked child never repeats its parent's ids


def mint_request_id(prefix: str) -> str:
    """A fresh unpredictable request id (80 bits from ``secrets``, drawn 256 ids at a time: one
    system call per id was a measurable part of an RLS call)."""
    if not _pool:
        raw = secrets.token_hex(_ID_HEX // 2 * _ids_per_draw)
        _pool.extend(raw[i:i + _ID_HEX] for i in range(0, len(raw), _ID_HEX))
    return f"{prefix}-{_pool.pop()}"


def question(fields: Mapping[str, str], *, cost: int, request_id: str) -> AdmitRequest:
    """One question from named fields (values as the gateway sent them): built directly
    (:func:`_direct`) when it is certainly valid, else by :func:`_question` (msgspec's strict
    convert), which refuses it."""
    req = _direct(fields, cost, request_id)
    if req is not None:
        return req
    return _question(fields, cost=cost, request_id=request_id)


def _direct(fields: Mapping[str, str], cost: int, request_id: str) -> AdmitRequest | None:
    """The question :func:`_question` makes of ``fields``, built without a body and without
    msgspec's convert (the principal and the question constructed, their constraints checked
    here: the lengths, the cost's range, the principal's identity text by its own check, the
    patterns by :func:`admit_of_text`), or None for anything it might refuse or that this does
    not check: :func:`_question` then decides, with its own reason. A first ask's question took
    about 3,350 ns with the body and the convert, 2,100 so (a remembered call asks neither: the
    door's memo knows it). The API key's length is the principal's own check alone (an empty or
    over-long key is not identity text or is too long: a ValueError, so None, as for any other
    key it refuses); the principal's id keeps its length check here, as an anonymous principal's
    id is not identity text and an empty one would pass the principal's check."""
    route = fields.get("route_group")
    if route is None or not (type(cost) is int and 1 <= cost <= MAX_COST):
        return None
    user, service, failed = fields.get("user"), fields.get("service"), fields.get("auth_failed")
    if user is not None and service is not None:
        return None
    ip = fields.get("client_ip")
    key = tenant = None
    auth_failed = False
    ptype: Literal["user", "service", "anonymous"]
    if failed == "true":
        if ip is None:
            return None
        ptype, pid, auth_failed, client_ip = "anonymous", ip, True, ip
    elif failed is not None and failed != "false":
        return None
    elif user is not None:
        if (tenant := fields.get("tenant")) is None:
            return None
        ptype, pid, key, client_ip = "user", user, fields.get("api_key"), ip
    elif service is not None:
        if (tenant := fields.get("tenant")) is None:
            return None
        ptype, pid, key, client_ip = "service", service, fields.get("api_key"), ip
    elif ip is not None and "tenant" not in fields and "api_key" not in fields:
        ptype, pid, client_ip = "anonymous", ip, None
    else:
        return None
    if not (0 < len(pid) <= ID_MAX_CHARS and (client_ip is None or 2 <= len(client_ip) <= 64)):
        return None
    try:  # (its __post_init__: identity text, and the API key's length: an empty or over-long key raises)
        principal = Principal(ptype, pid, key)
    except ValueError:
        return None
    return admit_of_text(AdmitText(request_id, principal, route, fields.get("method", "GET"), tenant, cost, None,
                                   auth_failed, client_ip))


def _question(fields: Mapping[str, str], *, cost: int, request_id: str) -> AdmitRequest:
    """:func:`question` by msgspec's strict convert: a body of the fields, converted (and refused)
    as a JSON question is decoded. Every valid question is built by :func:`_direct` first, so this
    runs for what it refuses (with its reason) and for whatever :func:`_direct` does not check."""
    route = fields.get("route_group")
    if route is None:
        raise BadQuestion("missing_route_group", "no route group")
    user, service = fields.get("user"), fields.get("service")
    if user is not None and service is not None:
        raise BadQuestion("conflicting_principal", "both a user and a service principal")
    failed = fields.get("auth_failed")
    if failed is not None and failed not in ("true", "false"):
        raise BadQuestion("bad_value", "auth_failed must be true or false")
    ip = fields.get("client_ip")
    body: dict = {"requestId": request_id, "routeGroup": route, "costHint": cost}
    if "method" in fields:
        body["method"] = fields["method"]
    if failed == "true":
        if ip is None:
            raise BadQuestion("missing_client_ip", "a failed authentication needs the client address")
        body.update(principal={"type": "anonymous", "id": ip}, authFailed=True, clientIp=ip)
    elif user is not None or service is not None:
        if "tenant" not in fields:
            raise BadQuestion("missing_tenant", "an authenticated principal needs its tenant")
        principal = {"type": "user" if user is not None else "service", "id": user if user is not None else service}
        if "api_key" in fields:
            principal["apiKeyId"] = fields["api_key"]
        body.update(tenantId=fields["tenant"], principal=principal)
        if ip is not None:  # the pre-authentication stage's rules marked everyRequest spend it too
            body["clientIp"] = ip
    elif ip is not None and "tenant" not in fields and "api_key" not in fields:
        body["principal"] = {"type": "anonymous", "id": ip}
    else:
        raise BadQuestion("missing_principal",
                          "neither a user/service principal (with its tenant) nor, alone, the client address")
    try:
        return _convert(body, AdmitRequest)
    except msgspec.ValidationError as e:
        raise BadQuestion("bad_value", str(e)) from None


def check_cost(cost: int) -> int:
    if not 1 <= cost <= MAX_COST:
        raise BadQuestion("bad_cost", f"cost (hits_addend) must be in [1, {MAX_COST}], got {cost}")
    return cost


class Descriptor(msgspec.Struct, frozen=True):
    """One RLS descriptor, protobuf-free: its entries, its own hits_addend (None when unset)
    and whether it carries a limit override. (A frozen struct, not a frozen dataclass: made for
    every descriptor of a call the door does not know, and a frozen dataclass's ``__init__`` sets
    each field through ``object.__setattr__``, about 1,000 ns against 100.)"""

    entries: tuple[tuple[str, str], ...]
    hits_addend: int | None = None
    has_limit_override: bool = False


class CallQuestions(msgspec.Struct, frozen=True):
    """The questions of one ``ShouldRateLimit`` call and how to ask them again.

    A call is a pure function of its bytes and the agent's :class:`Names`, except for the request
    ids minted for descriptors that name none: ``minted`` lists those questions, and :meth:`again`
    gives them fresh ids (with their ``:<index>`` suffix) while every other field, and an id the
    gateway named, stays as it is. The questions are frozen structs: sharing them is safe. (A
    frozen struct itself, as :class:`Descriptor` is, for the same reason.)"""

    questions: tuple[AdmitRequest, ...]
    minted: tuple[int, ...]  # indices of the questions whose request id was minted here

    def asked(self) -> AdmitRequest | list[AdmitRequest]:
        """:meth:`again`, but a call of one question (one descriptor: the common call) as that
        question alone, without a list."""
        qs = self.questions
        if len(qs) == 1:  # (one descriptor: no ``:<index>`` suffix)
            return _replace(qs[0], request_id=mint_request_id("rls")) if self.minted else qs[0]
        return self.again()

    def again(self) -> list[AdmitRequest]:
        """The same questions, each minted id replaced by a fresh one."""
        out = list(self.questions)
        if self.minted:
            suffixed = len(out) > 1
            for i in self.minted:
                rid = mint_request_id("rls")
                out[i] = _replace(out[i], request_id=f"{rid}:{i}" if suffixed else rid)
        return out


def rls_call(names: Names, domain: str, descriptors: list[Descriptor], hits_addend: int) -> CallQuestions:
    """The questions of one ``ShouldRateLimit`` call, one per descriptor, in order.

    Refused as a whole (:class:`BadQuestion`): another domain, no descriptor or more than
    ``rls_max_descriptors``, an entry key that is not in the mapping (``unknown_key``), a key
    given twice, a limit override (Leasehold's policy bundle is the only source of limits), a
    cost outside [1, 1000], and every malformed question. Several descriptors of one call are
    several decisions; their request ids get ``:<index>`` suffixes so idempotent rules keep
    one decision record each."""
    if domain != names.rls_domain:
        raise BadQuestion("unknown_domain", f"domain {domain[:64]!r} is not {names.rls_domain!r}")
    if not descriptors:
        raise BadQuestion("no_descriptors", "no descriptors")
    if len(descriptors) > names.rls_max_descriptors:
        raise BadQuestion("too_many_descriptors", f"more than {names.rls_max_descriptors} descriptors")
    out: list[AdmitRequest] = []
    minted: list[int] = []
    fields_of = names.rls_fields
    for i, d in enumerate(descriptors):
        if d.has_limit_override:
            raise BadQuestion("limit_override", f"descriptor {i} carries a limit override")
        fields: dict[str, str] = {}
        for key, value in d.entries:
            field = fields_of.get(key)
            if field is None:
                raise BadQuestion("unknown_key", f"descriptor {i}: key {key[:64]!r} is not mapped")
            if field in fields:
                raise BadQuestion("duplicate_key", f"descriptor {i}: key {key[:64]!r} given twice")
            fields[field] = value
        cost = check_cost(d.hits_addend if d.hits_addend is not None else (hits_addend or 1))
        rid = fields.pop("request_id", None)
        if not rid:
            rid = mint_request_id("rls")
            minted.append(i)
        if len(descriptors) > 1:
            rid = f"{rid[:120]}:{i}"
        out.append(question(fields, cost=cost, request_id=rid))
    return CallQuestions(tuple(out), tuple(minted))


def route_of(uri: str | None, prefixes: tuple[tuple[str, str], ...]) -> str | None:
    """The route group of the longest configured prefix of ``uri``'s path."""
    if uri is None or not prefixes:
        return None
    path = uri.split("?", 1)[0].split("#", 1)[0]
    for prefix, group in prefixes:
        if path.startswith(prefix) and (len(path) == len(prefix) or prefix.endswith("/")
                                        or path[len(prefix)] == "/"):
            return group
    return None


def authz_route(names: Names, headers: Mapping[str, str], forwarded_path: str | None) -> str | None:
    """The route group of a forward-auth request: the route group header the gateway sets (a
    constant per route or location in the shipped configurations), else the longest
    ``--authz-route-prefixes`` prefix of the original path."""
    h = names.headers
    group = headers.get(h["route_group"])
    if group is not None:
        return group
    return route_of(headers.get(h["uri"]) or forwarded_path, names.route_prefixes)


IDENTITY_FIELDS = ("tenant", "user", "service", "api_key", "auth_failed")


def without_identity(names: Names, headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` without any identity field (the bearer token is the only source then)."""
    drop = {names.headers[f] for f in IDENTITY_FIELDS}
    return {k: v for k, v in headers.items() if k not in drop}


def with_identity(names: Names, headers: Mapping[str, str], tenant: str, user: str,
                  api_key: str | None) -> dict[str, str]:
    """``headers`` with the identity of a verified token in place of any the request carried."""
    out = without_identity(names, headers)
    h = names.headers
    out[h["tenant"]], out[h["user"]] = tenant, user
    if api_key is not None:
        out[h["api_key"]] = api_key
    return out


def failed_authentication(names: Names, headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` as the question of a failed authentication (the caller's address alone)."""
    out = without_identity(names, headers)
    out[names.headers["auth_failed"]] = "true"
    return out


def authz_question(names: Names, headers: Mapping[str, str], *, method: str,
                   forwarded_path: str | None) -> AdmitRequest:
    """The question of one forward-auth request. ``headers``: lower-case name -> value (a name
    given twice must already have been refused); ``method`` the request's own method;
    ``forwarded_path`` the path after ``/v1/authz`` (Envoy ext_authz appends the original path)."""
    h = names.headers
    fields = {f: headers[h[f]] for f in FIELDS if h[f] in headers}
    if "route_group" not in fields:
        group = authz_route(names, headers, forwarded_path)
        if group is not None:
            fields["route_group"] = group
    fields.setdefault("method", method)
    raw_cost = headers.get(h["cost"], "1")
    if not raw_cost.isdigit() or len(raw_cost) > 4:
        raise BadQuestion("bad_cost", f"cost must be an integer in [1, {MAX_COST}]")
    rid = fields.pop("request_id", None) or mint_request_id("authz")
    return question(fields, cost=check_cost(int(raw_cost)), request_id=rid)


__all__ = ["AUTHZ_DEFAULT_HEADERS", "FIELDS", "IDENTITY_FIELDS", "RLS_DEFAULT_KEYS", "BadQuestion", "CallQuestions",
           "Descriptor",
           "Names", "authz_question", "authz_route", "failed_authentication", "parse_names", "with_identity",
           "without_identity", "parse_route_prefixes", "question", "rls_call", "route_of"]
