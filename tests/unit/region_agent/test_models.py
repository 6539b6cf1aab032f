"""region_agent.models: the decision record's enums keep their wire values; a principal's ids are identity text."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest

from kernel.algorithms.rule import Scope
from region_agent.models import Decision, DeniedScope, Principal, Reason


def test_denied_scope_wire_values_are_the_rule_scopes_plus_concurrency():
    assert [s.value for s in DeniedScope] == ["user", "key", "route", "tenant", "global", "concurrency", "ip"]
    # every rule scope maps to a denied scope by value (the engine's DeniedScope(rule.scope))
    assert {DeniedScope(s) for s in get_args(Scope)} == set(DeniedScope) - {DeniedScope.CONCURRENCY}


def test_decision_encodes_enums_as_their_strings():
    d = Decision(allowed=False, decision_id="r-1", rule_id="p", bundle_version=3,
                 denied_scope=DeniedScope.CONCURRENCY, reason=Reason.CONCURRENCY_EXCEEDED)
    body = msgspec.json.decode(msgspec.json.encode(d))
    assert (body["deniedScope"], body["reason"]) == ("concurrency", "CONCURRENCY_EXCEEDED")
    assert msgspec.json.decode(msgspec.json.encode(Decision(True, "r-2", None, 3)))["deniedScope"] is None


@pytest.mark.parametrize("text", [" admin", "admin ", "\tadmin", "admin\t", "ad\tmin", "U\x00", "U\x1f", "U\x7f",
                                  "U-1\r\nx-tenant-id: birch", " ", ""])
def test_a_principal_or_key_id_that_is_no_identity_text_is_refused_at_every_door(text):
    """One rule for every door's question (JSON, RLS descriptors, RLQS buckets, forward-auth headers):
    a principal or API key id is identity text, which a header carries as it is."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"type": "user", "id": text}, Principal)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"type": "user", "id": "U-1", "apiKeyId": text}, Principal)


@pytest.mark.parametrize("text", ["admin", "a b", "U-82-Zoë", "x", "\u00a0a", "K" * 256])
def test_identity_text_keeps_inner_spaces_and_any_printable_character(text):
    assert msgspec.convert({"type": "user", "id": text, "apiKeyId": text}, Principal).id == text


@pytest.mark.parametrize("field", ["id", "api_key_id"])
def test_a_principal_built_in_process_is_held_to_the_wire_types_length(field):
    """Library mode builds a Principal without a decoder: the same 256 characters at most."""
    ids = {"id": "U-1", "api_key_id": "K-1"}
    assert Principal(type="user", **{**ids, field: "K" * 256})
    with pytest.raises(ValueError, match="at most 256"):
        Principal(type="user", **{**ids, field: "K" * 257})
    with pytest.raises(msgspec.ValidationError):  # the decoder's own check still answers first
        msgspec.convert({"type": "user", "id": "U-1", "apiKeyId": "K-1", {"id": "id", "api_key_id": "apiKeyId"}[field]: "K" * 257}, Principal)
