"""region_agent.models: the decision record's enums keep their wire values."""

from __future__ import annotations

from typing import get_args

import msgspec

from kernel.algorithms.rule import Scope
from region_agent.models import Decision, DeniedScope, Reason


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
