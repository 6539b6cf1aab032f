"""The batch fast path's repeated-key check (kernel.jsonbody.repeats_keys with
region_agent.models.keys_shown): exact against the full check, and the count alone decides for
the compact bodies gateways send."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel import jsonbody
from kernel.jsonbody import has_duplicate_keys, repeats_keys
from region_agent.models import AdmitBatch, keys_shown

OPTIONAL = {"method": st.sampled_from(["GET", "POST"]), "tenantId": st.sampled_from(["atlas", "birch"]),
            "costHint": st.integers(1, 5), "policyEpoch": st.integers(0, 9), "authFailed": st.booleans(),
            "clientIp": st.sampled_from(["10.0.0.1", "::1"])}


@st.composite
def items(draw) -> dict:
    item: dict = {"requestId": draw(st.from_regex(r"[a-z0-9:-]{8,20}", fullmatch=True)),
                  "principal": {"type": "user", "id": draw(st.sampled_from(["U-1", ":U-2", "a b"]))},
                  "routeGroup": "read"}
    if draw(st.booleans()):
        item["principal"]["apiKeyId"] = "K1"
    for name, strat in OPTIONAL.items():
        if draw(st.booleans()):
            item[name] = draw(strat)
    return item


def _with_repeat(body: str, key: str, value: str) -> str:
    """The first object holding ``key`` gets it a second time."""
    at = body.find(f'"{key}":')
    return body if at < 0 else body[:at] + f'"{key}":{value},' + body[at:]


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(items(), max_size=6), repeat=st.sampled_from([None, "requestId", "id", "costHint", "method"]),
       spaced=st.booleans())
def test_the_counting_check_agrees_with_the_full_check(batch, repeat, spaced):
    body = json.dumps({"requests": batch}, separators=(", ", ": ") if spaced else (",", ":"))
    if repeat is not None:
        body = _with_repeat(body, repeat, {"requestId": '"zzzzzzzz0"', "id": '"U-9"', "costHint": "1",
                                           "method": '"GET"'}[repeat])
    raw = body.encode()
    try:
        decoded = msgspec.json.decode(raw, type=AdmitBatch)
    except msgspec.ValidationError:
        return
    shown = 1 + sum(map(keys_shown, decoded.requests))
    assert repeats_keys(raw, shown) == has_duplicate_keys(raw)


def test_a_compact_batch_is_judged_by_the_count_alone(monkeypatch):
    batch = {"requests": [{"requestId": f"req-{i:08d}", "principal": {"type": "user", "id": f"U-{i}"},
                           "routeGroup": "read", "tenantId": "atlas", "costHint": 2} for i in range(100)]}
    raw = json.dumps(batch, separators=(",", ":")).encode()
    decoded = msgspec.json.decode(raw, type=AdmitBatch)

    def full(_body):
        raise AssertionError("the full check ran")

    monkeypatch.setattr(jsonbody, "has_duplicate_keys", full)
    assert repeats_keys(raw, 1 + sum(map(keys_shown, decoded.requests))) is False
    with pytest.raises(AssertionError):  # a default spelled out: the count cannot decide
        spelled = raw.replace(b'"costHint":2', b'"costHint":2,"method":"GET"', 1)
        repeats_keys(spelled, 1 + sum(map(keys_shown, msgspec.json.decode(spelled, type=AdmitBatch).requests)))
