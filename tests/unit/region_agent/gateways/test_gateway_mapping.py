"""Pure translation between gateways' protocols and Leasehold's question and answer
(region_agent.gateways.mapping / .answer): settings parsing, descriptor and header mapping,
units of current_limit, and which decision's answer the caller gets."""

from __future__ import annotations

import dataclasses
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.bundle import load_bundle_file
from region_agent.decision.plan import Snapshot
from region_agent.gateways import mapping
from region_agent.gateways.answer import authz_answer, deciding, per_unit, rls_answer
from region_agent.gateways.authz import _headers
from region_agent.gateways.mapping import (
    AUTHZ_DEFAULT_HEADERS,
    DESCRIPTOR_KEY_RE,
    RLS_DEFAULT_KEYS,
    BadQuestion,
    Descriptor,
    Names,
    authz_question,
    parse_names,
    parse_route_prefixes,
    rls_call,
    route_of,
)
from region_agent.models import Decision
from region_agent.service.settings import load_agent_settings

NAMES = Names.build(authz_route_prefixes=["/reports/export=export", "/login=login", "/=read"])
BUNDLE = load_bundle_file("policies/northstar.json")
GLOBAL = load_bundle_file("policies/northstar-global.json")


def questions(*args) -> list:
    return list(rls_call(*args).questions)


def d(*entries: tuple[str, str], hits: int | None = None, limit: bool = False) -> Descriptor:
    return Descriptor(entries=entries, hits_addend=hits, has_limit_override=limit)


def test_default_names_are_distinct_and_overridable():
    assert len(set(RLS_DEFAULT_KEYS.values())) == len(RLS_DEFAULT_KEYS)
    assert len(set(AUTHZ_DEFAULT_HEADERS.values())) == len(AUTHZ_DEFAULT_HEADERS)
    n = Names.build(rls_keys=["client_ip=source_ip", "tenant=org"], authz_headers=["tenant=X-Org-Id"])
    assert n.rls_fields["source_ip"] == "client_ip" and n.rls_fields["org"] == "tenant"
    assert "remote_address" not in n.rls_fields and n.headers["tenant"] == "x-org-id"


@pytest.mark.parametrize("items", [["bogus=x"], ["tenant"], ["tenant=has space"], ["tenant=user"],
                                   ["tenant=a", "user=a"]])
def test_bad_rls_key_overrides_are_settings_errors(items):
    with pytest.raises(ValueError):
        parse_names(items, RLS_DEFAULT_KEYS, DESCRIPTOR_KEY_RE, "rls key")


def test_settings_validate_the_mapping_at_start():
    with pytest.raises(SystemExit):
        load_agent_settings(["--rls-keys", "tenant=user"])
    with pytest.raises(SystemExit):
        load_agent_settings(["--authz-route-prefixes", "reports=export"])
    s = load_agent_settings(["--rls-port", "9090", "--authz-route-prefixes", "/a=x,/a/b=y"])
    assert s.rls_port == 9090 and s.authz_route_prefixes == ["/a=x", "/a/b=y"]


def test_route_prefixes_longest_first_on_path_segments():
    p = parse_route_prefixes(["/=read", "/reports/export=export", "/login=login"])
    assert route_of("/reports/export/q3?x=1", p) == "export"
    assert route_of("/reports/exporter", p) == "read"  # not a path-segment prefix
    assert route_of("/login", p) == "login" and route_of("/catalog", p) == "read"
    assert route_of("/x", parse_route_prefixes(["/y=read"])) is None
    with pytest.raises(ValueError):
        parse_route_prefixes(["/a=read", "/a=export"])


def test_one_descriptor_one_question():
    (q,) = questions(NAMES, "leasehold", [d(("tenant", "atlas"), ("user", "U-17"), ("api_key", "K1"),
                                                 ("route_group", "read"), ("request_id", "req-12345678"))], 3)
    assert (q.tenant_id, q.principal.type, q.principal.id, q.principal.api_key_id, q.route_group, q.cost_hint,
            q.request_id) == ("atlas", "user", "U-17", "K1", "read", 3, "req-12345678")
    (q,) = questions(NAMES, "leasehold", [d(("remote_address", "203.0.113.9"), ("route_group", "login"), hits=2)], 5)
    assert q.principal.type == "anonymous" and q.principal.id == "203.0.113.9" and q.cost_hint == 2
    (q,) = questions(NAMES, "leasehold", [d(("remote_address", "203.0.113.9"), ("auth_failed", "true"),
                                                 ("tenant", "atlas"), ("user", "U-17"), ("route_group", "login"))], 0)
    assert q.auth_failed and q.client_ip == "203.0.113.9" and q.cost_hint == 1
    qs = questions(NAMES, "leasehold", [d(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"),
                                              ("request_id", "req-12345678"))] * 2, 0)
    assert [q.request_id for q in qs] == ["req-12345678:0", "req-12345678:1"]  # one decision record each


@pytest.mark.parametrize(("descs", "reason"), [
    ([d(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), limit=True)], "limit_override"),
    ([d(("generic_key", "x"), ("route_group", "read"))], "unknown_key"),
    ([d(("service", "S"), ("route_group", "read"), ("tenant", "atlas"), ("user", "U"))], "conflicting_principal"),
    ([d(("remote_address", "1.2.3.4"), ("route_group", "login"), ("auth_failed", "yes"))], "bad_value"),
    ([d(("auth_failed", "true"), ("route_group", "login"))], "missing_client_ip"),
    ([d(("remote_address", "1.2.3.4"), ("tenant", "atlas"), ("route_group", "login"))], "missing_principal"),
    ([d(("tenant", "atlas"), ("user", "U-1"), ("route_group", "Read"))], "bad_value"),
    ([d(("tenant", "atlas"), ("user", "U-1"), ("route_group", "read"), ("method", "get"))], "bad_value"),
    # no identity text (kernel.ids.ID_TEXT): a gateway that did not check the claim it copied
    ([d(("tenant", "atlas"), ("user", " admin"), ("route_group", "read"))], "bad_value"),
    ([d(("tenant", "atlas"), ("user", "admin\t"), ("route_group", "read"))], "bad_value"),
    ([d(("tenant", "atlas"), ("service", "svc\x00"), ("route_group", "read"))], "bad_value"),
    ([d(("tenant", "atlas"), ("user", "U-1"), ("api_key", "K1 "), ("route_group", "read"))], "bad_value"),
])
def test_malformed_descriptors(descs, reason):
    with pytest.raises(BadQuestion) as e:
        questions(NAMES, "leasehold", descs, 1)
    assert e.value.reason == reason and e.value.status == 422


def test_authz_question_from_headers():
    h = {"x-tenant-id": "atlas", "x-user-id": "U-17", "x-forwarded-uri": "/reports/export/1", "x-leasehold-cost": "2",
         "x-request-id": "0f8e7d6c-5b4a-4938-8271-605f4e3d2c1b", "x-forwarded-method": "POST"}
    q = authz_question(NAMES, h, method="GET", forwarded_path=None)
    assert (q.route_group, q.cost_hint, q.method, q.request_id) == ("export", 2, "POST", h["x-request-id"])
    q = authz_question(NAMES, {"x-real-ip": "2001:db8::1"}, method="DELETE", forwarded_path="/login")
    assert q.principal.type == "anonymous" and q.route_group == "login" and q.method == "DELETE"
    assert q.request_id.startswith("authz-")
    q = authz_question(NAMES, {"x-real-ip": "2001:db8::1", "x-route-group": "export", "x-forwarded-uri": "/login"},
                       method="GET", forwarded_path=None)
    assert q.route_group == "export"  # an explicit route group wins over the prefix map


def test_duplicate_identity_headers_are_refused_other_duplicates_are_not():
    scope = {"headers": [(b"x-user-id", b"U-7"), (b"X-User-Id", b"U-8")]}
    with pytest.raises(BadQuestion) as e:
        _headers(scope, frozenset({"x-user-id"}))
    assert e.value.reason == "duplicate_header"
    assert _headers({"headers": [(b"accept", b"a"), (b"accept", b"b")]}, frozenset({"x-user-id"})) == {"accept": "b"}


def test_per_unit_of_the_northstar_rules():
    rules = {r.id: r for r in BUNDLE.rules}
    assert per_unit(rules["read-user-v3"], Snapshot(BUNDLE)) == (2, "SECOND")  # 2,000 millitokens per 1,000 ms
    assert per_unit(rules["tenant-atlas-minute"], Snapshot(BUNDLE)) == (1000, "MINUTE")
    assert per_unit(rules["anon-login"], Snapshot(BUNDLE)) is None  # 20 per 10 s is no whole unit
    g = {r.id: r for r in GLOBAL.rules}
    assert per_unit(g["tenant-birch-global"], Snapshot(GLOBAL)) == (300, "MINUTE")
    assert per_unit(g["global-catalog"], Snapshot(GLOBAL)) == (40000, "SECOND")


def dec(status: int, retry: int = 0, **kw) -> Decision:
    return Decision(allowed=status == 200, decision_id="r-1", rule_id=kw.pop("rule_id", "read-user-v3"),
                    bundle_version=42, http_status=status, retry_after_ms=retry, **kw)


def test_the_deciding_decision():
    ok_own = dec(200, headers={"RateLimit": "x"})
    assert deciding([dec(200), ok_own]) is ok_own
    a, b, c = dec(429, 500), dec(429, 3500), dec(503, 5000)
    assert deciding([a, b]) is b and deciding([b, c, a]) is c
    never = dec(429, -1)
    assert deciding([b, never]) is never


def test_rls_answer_mirrors_the_http_answer():
    deny = dec(429, 500, limit=20, remaining=0, problem={"status": 429},
               headers={"Retry-After": "1", "RateLimit": '"read-user-v3";r=0;t=1'})
    ans = rls_answer([dec(200, limit=20, remaining=4), deny], Snapshot(BUNDLE), [False, False])
    assert ans.over_limit and ans.http_status == 429
    assert ans.headers == {"Retry-After": "1", "RateLimit": '"read-user-v3";r=0;t=1',
                           "content-type": "application/problem+json"}
    assert msgspec.json.decode(ans.body) == {"status": 429} and ans.metadata == {"status": 429, "reason": ""}
    assert [(s.over_limit, s.remaining, s.reset_ms) for s in ans.statuses] == [(False, 4, 0), (True, 0, 500)]
    fb = rls_answer([dec(200, limit=5, remaining=4, fallback=True)], Snapshot(BUNDLE), [False])
    assert fb.statuses[0].limit_name is None  # a local allowance is not the rule's limit


def test_authz_answer_statuses():
    deny = dec(503, 5000, headers={"Retry-After": "5"}, problem={"status": 503})
    a = authz_answer(deny)
    assert a.status == 503 and a.headers["Retry-After"] == "5" and a.headers["content-type"] == "application/problem+json"
    a = authz_answer(deny, deny_status=403)
    assert a.status == 403 and a.headers["x-leasehold-status"] == "503"
    ok = authz_answer(dec(200, headers={"RateLimit": "r"}), deny_status=403)
    assert (ok.status, ok.headers, ok.body) == (200, {"RateLimit": "r"}, b"")


def _outcome(fields: dict[str, str], request_id: str) -> tuple:
    try:
        return ("asked", mapping.question(fields, cost=3, request_id=request_id))
    except BadQuestion as e:
        return ("refused", e.reason, str(e), e.errors)


_IDENTITIES = {"tenant": ["atlas", "Atlas", "a" * 33, "at las", ""], "route_group": ["read", "Read", "re/ad", ""],
               "method": ["GET", "get", "P0ST", "POST\n"], "user": ["U-17", " admin", "admin\t", "\u00e9t\u00e9", "x" * 257]}


@settings(max_examples=300, deadline=None)
@given(tenant=st.sampled_from(_IDENTITIES["tenant"]), route=st.sampled_from(_IDENTITIES["route_group"]),
       method=st.none() | st.sampled_from(_IDENTITIES["method"]), user=st.sampled_from(_IDENTITIES["user"]),
       request_id=st.sampled_from(["rls-0123456789abcdef0123", "req-12345678:1", "r", "r id", "r\u00e9q-1", "-x"]),
       ip=st.none() | st.sampled_from(["203.0.113.9", "1"]))
def test_a_question_is_the_strict_conversions_or_refused_for_its_reason(tenant, route, method, user, request_id, ip):
    """The question built without msgspec's identity patterns (checked by admit_of_text) is the
    strict conversion's, and every question the strict conversion refuses is refused with the
    same reason and message (the strict path alone: admit_of_text never answers, so nothing is
    built directly)."""
    fields = {"tenant": tenant, "route_group": route, "user": user}
    if method is not None:
        fields["method"] = method
    if ip is not None:
        fields["client_ip"] = ip
    got = _outcome(fields, request_id)
    with mock.patch.object(mapping, "admit_of_text", lambda t: None):
        want = _outcome(fields, request_id)
    assert got == want


def _strict(fields: dict[str, str], cost: object, request_id: str) -> tuple:
    """The question as msgspec's strict convert alone makes it (no direct build)."""
    try:
        return ("asked", mapping._question(fields, cost=cost, request_id=request_id))  # type: ignore[arg-type]  # a cost that is no int is tried too
    except BadQuestion as e:
        return ("refused", e.reason, str(e), e.errors)


_FIELD_VALUES = {"route_group": ["read", "re/ad", ""], "user": ["U-17", " admin", "", "x" * 256, "x" * 257, "\u00e9t\u00e9"],
                 "service": ["svc-1", "svc\x00"], "tenant": ["atlas", "at las", ""],
                 "api_key": ["k-1", "", "k" * 256, "k" * 257, "k\t"], "auth_failed": ["true", "false", "yes"],
                 "client_ip": ["203.0.113.9", "1", "", "9" * 64, "9" * 65], "method": ["GET", "get", "POST"]}


@settings(max_examples=600, deadline=None)
@given(fields=st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in _FIELD_VALUES.items()}),
       cost=st.sampled_from([1, 3, 1000, 0, 1001, True]),
       request_id=st.sampled_from(["rls-0123456789abcdef0123", "r", "r id"]))
def test_a_question_built_directly_is_the_converts(fields, cost, request_id):
    """mapping._direct builds a question without msgspec's convert: every question it builds is the
    one the strict convert makes, and everything else (any principal branch, an id or address of a
    length the wire types refuse, identity text that is not, a cost outside [1, 1000] or not an
    int, a bad pattern) is left to the converts, so refused with the same reason and message."""
    try:
        got: tuple = ("asked", mapping.question(fields, cost=cost, request_id=request_id))
    except BadQuestion as e:
        got = ("refused", e.reason, str(e), e.errors)
    assert got == _strict(fields, cost, request_id)


_VALID = [
    {"route_group": "read", "user": "U-17", "tenant": "atlas"},
    {"route_group": "read", "service": "svc-1", "tenant": "atlas", "api_key": "k-1", "client_ip": "203.0.113.9",
     "method": "POST"},
    {"route_group": "read", "client_ip": "203.0.113.9"},
    {"route_group": "login", "user": "U-17", "tenant": "atlas", "auth_failed": "true", "client_ip": "203.0.113.9"},
]


@pytest.mark.parametrize("base", _VALID)
def test_every_one_field_change_of_a_valid_question_is_the_converts(base):
    """Each valid question of every principal branch with one field changed (every value above)
    or left out, at every cost: the direct build's outcome is the strict convert's."""
    changed = [{k: v for k, v in base.items() if k != key} for key in base]
    changed += [{**base, key: v} for key, values in _FIELD_VALUES.items() for v in values]
    for fields in changed:
        for cost in (1, 1000, 0, 1001, True):
            try:
                got: tuple = ("asked", mapping.question(fields, cost=cost, request_id="rls-0123456789abcdef0123"))
            except BadQuestion as e:
                got = ("refused", e.reason, str(e), e.errors)
            assert got == _strict(fields, cost, "rls-0123456789abcdef0123"), (fields, cost)


@pytest.mark.parametrize("principal", ["user", "service"])
@pytest.mark.parametrize(("key", "built"), [("k" * 256, True), ("k" * 257, False), ("", False)])
def test_an_api_keys_length_is_the_principals_check_through_the_rls_door(principal, key, built):
    """An API key at the limit (256 characters) is built directly; an over-long or an empty one is
    left by the principal's own check to the strict convert, which refuses it for its reason, as
    the strict path alone does: through the RLS door, the question or the refusal is the same."""
    rid = "rls-0123456789abcdef0123"
    call = [d(("tenant", "atlas"), (principal, "U-17"), ("api_key", key), ("route_group", "read"),
              ("request_id", rid))]
    fields = {"tenant": "atlas", principal: "U-17", "api_key": key, "route_group": "read"}
    assert (mapping._direct(fields, 1, rid) is not None) == built
    want = _strict(fields, 1, rid)
    try:
        got: tuple = ("asked", questions(NAMES, "leasehold", call, 1)[0])
    except BadQuestion as e:
        got = ("refused", e.reason, str(e), e.errors)
    assert got == want and (want[0] == "asked") == built
    if not built:
        assert want[1] == "bad_value" and "apiKeyId" in want[2]


@pytest.mark.parametrize("fields", _VALID)
def test_a_valid_question_is_built_without_the_converts(fields):
    """Every principal branch's valid question is built directly (the converts never run)."""
    want = _strict(fields, 2, "rls-0123456789abcdef0123")[1]
    with mock.patch.object(mapping, "_question", side_effect=AssertionError("converted")):
        assert mapping.question(fields, cost=2, request_id="rls-0123456789abcdef0123") == want


def test_descriptor_and_call_questions_keep_the_frozen_dataclasses_behaviour():
    """Descriptor and CallQuestions are frozen structs (cheaper to make than the frozen dataclasses
    they were): the same fields in the same order with the same defaults, made by position or by
    name, equal and hashed by value, and immutable."""
    @dataclasses.dataclass(frozen=True, slots=True)
    class OldDescriptor:
        entries: tuple[tuple[str, str], ...]
        hits_addend: int | None = None
        has_limit_override: bool = False

    @dataclasses.dataclass(frozen=True, slots=True)
    class OldCallQuestions:
        questions: tuple
        minted: tuple[int, ...]

    for new, old in ((Descriptor, OldDescriptor), (mapping.CallQuestions, OldCallQuestions)):
        assert new.__struct_fields__ == tuple(f.name for f in dataclasses.fields(old))
        assert new.__struct_defaults__ == tuple(f.default for f in dataclasses.fields(old)
                                                if f.default is not dataclasses.MISSING)
    e = (("user", "U-17"), ("tenant", "atlas"))
    a, b = Descriptor(e, 3, True), Descriptor(entries=e, hits_addend=3, has_limit_override=True)
    assert a == b and hash(a) == hash(b) and a != Descriptor(e, 3) and Descriptor(e) == Descriptor(e, None, False)
    assert dataclasses.astuple(OldDescriptor(e, 3, True)) == msgspec.structs.astuple(a)
    call = mapping.CallQuestions((), (0,))
    assert call == mapping.CallQuestions(questions=(), minted=(0,)) and hash(call) == hash(mapping.CallQuestions((), (0,)))
    for obj, name in ((a, "hits_addend"), (call, "minted")):
        with pytest.raises(AttributeError):
            setattr(obj, name, None)
