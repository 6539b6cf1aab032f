"""The HTTP door's decode of ``POST /v1/admit`` (region_agent.service.fastpath.decode_admit) serves
exactly the bodies the strict decode into :class:`AdmitRequest` serves, each as the same value: it
reads the body as :class:`AdmitText` (the wire type without its identity patterns) and checks those
fields by their patterns' character classes. Any body it does not serve goes to the handler, whose
strict decode gives the 400 it gave."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.jsonbody import repeats_keys
from region_agent import models
from region_agent.models import AdmitRequest, AdmitText, keys_shown
from region_agent.service.fastpath import decode_admit


def _strict(body: bytes) -> AdmitRequest | None:
    """What the fast path served before: the strict decode, and no repeated key."""
    try:
        req = msgspec.json.decode(body, type=AdmitRequest)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if repeats_keys(body, keys_shown(req)) else req


def _without_patterns(info: msgspec.inspect.Type) -> msgspec.inspect.Type:
    if isinstance(info, msgspec.inspect.StrType):
        return msgspec.structs.replace(info, pattern=None)
    if isinstance(info, msgspec.inspect.UnionType):
        return msgspec.structs.replace(info, types=tuple(_without_patterns(t) for t in info.types))
    return info


def test_admit_text_is_the_wire_type_without_its_patterns():
    strict = msgspec.inspect.type_info(AdmitRequest)
    loose = msgspec.inspect.type_info(AdmitText)
    assert (loose.forbid_unknown_fields, loose.array_like) == (strict.forbid_unknown_fields, strict.array_like)
    assert len(loose.fields) == len(strict.fields)
    patterned = set()
    for a, b in zip(strict.fields, loose.fields, strict=True):
        assert (a.name, a.encode_name, a.required, a.default, a.default_factory) == \
               (b.name, b.encode_name, b.required, b.default, b.default_factory)
        assert _without_patterns(a.type) == b.type, a.name
        if _without_patterns(a.type) != a.type:
            patterned.add(a.name)
    assert patterned == {"request_id", "route_group", "method", "tenant_id"}  # what decode_admit checks


_TEXT = st.text(alphabet=st.sampled_from(list("abcXYZ09._:-_ @\n/é") + ["\u212a"]), max_size=40)
VALUES = {
    "requestId": st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{8,128}", fullmatch=True), _TEXT,
                           st.sampled_from(["r-0001abcd\n", "a" * 128, "a" * 129, "short", "r" * 7]), st.integers()),
    "routeGroup": st.one_of(st.sampled_from(["read", "read_all", "Read", "read all", "", "r" * 32, "r" * 33]), _TEXT),
    "method": st.one_of(st.sampled_from(["GET", "POST", "get", "", "G" * 16, "G" * 17, "GÉT"]), _TEXT),
    "tenantId": st.one_of(st.sampled_from(["atlas", "atlas-2", "Atlas", "a_b", "t" * 32, "t" * 33]), _TEXT, st.none()),
    "costHint": st.integers(0, 1001),
    "policyEpoch": st.one_of(st.integers(-1, 3), st.none()),
    "authFailed": st.booleans(),
    "clientIp": st.sampled_from(["10.0.0.1", "x", None]),
    "extra": st.just(1),
}
VALID = {"requestId": st.from_regex(r"[A-Za-z0-9._:-]{8,40}", fullmatch=True),
         "routeGroup": st.from_regex(r"[a-z0-9_-]{1,32}", fullmatch=True), "method": st.sampled_from(["GET", "POST"]),
         "tenantId": st.from_regex(r"[a-z0-9-]{1,32}", fullmatch=True), "costHint": st.integers(1, 1000),
         "policyEpoch": st.integers(0, 9), "authFailed": st.just(False), "clientIp": st.just("10.0.0.1")}


def _value(draw, name: str):
    """Mostly a value the wire type takes (so that many bodies are served), else anything near."""
    if name in VALID and draw(st.integers(0, 3)):
        return draw(VALID[name])
    return draw(VALUES[name])


@st.composite
def bodies(draw) -> bytes:
    body: dict = {}
    for name in ("requestId", "routeGroup"):
        if draw(st.integers(0, 9)):  # now and then a required field is missing
            body[name] = _value(draw, name)
    body["principal"] = draw(st.sampled_from([{"type": "user", "id": "U-17"}, {"type": "user", "id": " admin"},
                                              {"type": "anonymous", "id": "10.0.0.9"}, {"type": "user", "id": "U-2"},
                                              {"type": "service", "id": "svc", "apiKeyId": "K1"}]))
    for name in ("method", "tenantId", "costHint", "policyEpoch", "authFailed", "clientIp"):
        if draw(st.integers(0, 2)) == 0:
            body[name] = _value(draw, name)
    if draw(st.integers(0, 19)) == 0:
        body["extra"] = 1  # an unknown field
    names = list(body)
    order = draw(st.permutations(names))
    text = json.dumps({k: body[k] for k in order}, separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    if draw(st.integers(0, 9)) == 0:  # a repeated key
        text = text.replace('"principal"', '"routeGroup":"read","principal"', 1)
    return text.encode()


@settings(max_examples=3_000, deadline=None)
@given(body=bodies())
def test_decode_admit_serves_what_the_strict_decode_serves(body):
    assert decode_admit(body, False) == _strict(body)
    got = decode_admit(body, False)
    if got is not None:
        assert type(got) is AdmitRequest and type(got.principal) is type(_strict(body).principal)


@pytest.mark.parametrize("field, value", [
    ("requestId", "r-0001abcd\n"), ("requestId", "short"), ("requestId", "a" * 129), ("requestId", "r-0001 abcd"),
    ("routeGroup", "Read"), ("routeGroup", "r" * 33), ("routeGroup", ""), ("method", "get"), ("method", "G" * 17),
    ("tenantId", "Atlas"), ("tenantId", "a_b"), ("tenantId", ""), ("requestId", "r-0001abcé"),
])
def test_a_field_its_pattern_refuses_is_handed_over(field, value):
    body = {"requestId": "r-0001abcd", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read",
            "tenantId": "atlas", field: value}
    raw = json.dumps(body).encode()
    assert decode_admit(raw, False) is None
    with pytest.raises(msgspec.ValidationError):  # the handler's strict decode refuses it (its 400)
        msgspec.json.decode(raw, type=AdmitRequest)
    body[field] = {"requestId": "r-0001abcd", "routeGroup": "read", "method": "GET", "tenantId": "atlas"}[field]
    assert decode_admit(json.dumps(body).encode(), False) == msgspec.json.decode(json.dumps(body), type=AdmitRequest)


def test_only_values_a_pattern_took_are_learned_and_the_sets_stay_bounded(monkeypatch):
    monkeypatch.setattr(models, "_tenants", set())
    monkeypatch.setattr(models, "LEARNED_MAX", 3)
    body = {"requestId": "r-0001abcd", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read"}
    assert decode_admit(json.dumps({**body, "tenantId": "Atlas"}).encode(), False) is None
    assert models._tenants == set()  # refused: not learned, refused again
    assert decode_admit(json.dumps({**body, "tenantId": "Atlas"}).encode(), False) is None
    for tenant in ("t1", "t2", "t3", "t4"):
        assert decode_admit(json.dumps({**body, "tenantId": tenant}).encode(), False).tenant_id == tenant
    assert models._tenants == {"t4"}  # full at three: emptied, then the fourth
