"""One decision's script call and its reply (region_agent/decision/call.py): the shape checks made before
sending, and the reply parsing, conflict and error slots included (pure)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kernel.bundle import load_bundle_file
from kernel.errors import DecisionConflict, ScriptRejected, StoreUnavailable
from region_agent.decision.call import (
    MAX_RULES,
    Call,
    MultiRuleResult,
    PoolTake,
    multi_rule_call,
    parse_multi_rule,
    parse_pool_take,
    plan_calls,
    pool_take_call,
    result_of,
)
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.models import AdmitRequest, Principal

TB = Call("rl:{t:a}:x", "tb", (20_000, 2_000, 1_000, 1_000, 0))
CC = Call("rl:{t:a}:x:cc", "cc", (3, 60_000, 0, 0, 0))


def test_keys_and_argv_follow_the_script_header():
    name, keys, argv = multi_rule_call([CC, TB], decision_key="rl:{t:a}:d:r1", slack_ms=5_000, decision_ttl_ms=30_000,
                                       member="r1", question="q")
    assert name == "multi_rule[cc,tb]"  # the lean variant for the slots' kinds
    assert keys == ["rl:{t:a}:d:r1", CC.key, TB.key]
    assert argv == [5_000, 30_000, "r1", "cc", 3, 60_000, 0, 0, 0, "tb", 20_000, 2_000, 1_000, 1_000, 0, "q"]


@pytest.mark.parametrize(("calls", "message"), [
    ([], "1..8"),
    ([TB._replace(key=f"k{i}") for i in range(MAX_RULES + 1)], "1..8"),
    ([TB._replace(kind="xx")], "unknown rule kind"),
    ([TB._replace(params=(1, 2, 3))], "five parameters"),
    ([TB, TB], "same key"),
])
def test_shape_errors_are_refused_before_sending(calls, message):
    with pytest.raises(ScriptRejected, match=message):
        multi_rule_call(calls, decision_key="d", slack_ms=0, decision_ttl_ms=0, member="m")


def test_reply_parsing():
    assert parse_multi_rule([1, 0, 0, b"19000", 7]) == MultiRuleResult(True, 0, 0, (19_000, 7))
    assert parse_multi_rule([0, 2, -1, 0, 0]) == MultiRuleResult(False, 2, -1, (0, 0))
    with pytest.raises(DecisionConflict):
        parse_multi_rule([-1, 0, 0, 0])
    for bad in (None, [1, 0], ["x", 0, 0, 0], "OK"):
        with pytest.raises(ScriptRejected):
            parse_multi_rule(bad)


def test_an_error_in_the_reply_slot_is_raised_as_a_contract_error():
    err = ScriptRejected("bad args")
    with pytest.raises(ScriptRejected) as e:
        parse_multi_rule(err)
    assert e.value is err
    with pytest.raises(StoreUnavailable):  # a driver error that escaped translation: never a 500
        parse_multi_rule(ConnectionError("reset"))


def test_pool_take():
    assert pool_take_call("rl:{g:p}", min_tokens=1, want=20, slack_ms=0) == ("pool_take", ["rl:{g:p}"], [1, 20, 0, 0, 0])
    assert pool_take_call("rl:{g:p}", min_tokens=1, want=20, slack_ms=0, per_s=80)[2] == [1, 20, 0, 80, 0]
    assert pool_take_call("rl:{g:p}", min_tokens=1, want=20, slack_ms=0, per_s=80, waiting=7)[2] == [1, 20, 0, 80, 7]
    assert parse_pool_take([20, 80, 900, 0]) == PoolTake(20, 80, 900, 0)
    with pytest.raises(ScriptRejected):
        parse_pool_take([1, 2, 3])


# --- a plan's calls -------------------------------------------------------------------------------
def _plan(shadow: bool = False):
    bundle = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
    if shadow:
        bundle = msgspec.structs.replace(bundle, rules=[msgspec.structs.replace(r, shadow=True)
                                                        if r.id == "tenant-atlas-minute" else r for r in bundle.rules])
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas", route_group="read",
                       principal=Principal(type="user", id="U-17", api_key_id="K1"))
    return build_plan(Snapshot(bundle), req, KeyBuilder(b"unit-pepper"))


def test_plan_calls_are_the_enforced_call_then_the_shadow_call():
    plan = _plan()
    (enforced,) = plan_calls(plan)
    assert enforced == multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                       decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                                       question=plan.question)
    with_shadow = _plan(shadow=True)
    enforced, shadow = plan_calls(with_shadow)
    assert len(enforced[1]) == 2 and len(shadow[1]) == 2  # decision key + one rule each
    assert shadow[2][1] == 0  # the shadow call never writes a decision record


def test_result_of_turns_a_contract_error_into_a_value():
    assert result_of([1, 0, 0, 5]) == MultiRuleResult(True, 0, 0, (5,))
    assert isinstance(result_of([-1, 0, 0, 0]), DecisionConflict)
    assert isinstance(result_of(StoreUnavailable("x")), StoreUnavailable)
    assert isinstance(result_of("nonsense"), ScriptRejected)
