"""region_agent.service.policy_watch: the conservative answer of revocable rules once the snapshot is
stale, and the policy-age gauge (the etcd watcher itself: tests/integration)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import load_bundle_file
from region_agent.decision.plan import Snapshot
from region_agent.models import AdmitRequest, DeniedScope, Principal, Reason
from region_agent.service.metrics import AgentMetrics
from region_agent.service.policy_watch import age_gauge, revoked_decision

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))


def with_revocable(*ids: str):
    rules = [msgspec.structs.replace(r, revocable=True) if r.id in ids else r for r in NORTHSTAR.rules]
    return msgspec.structs.replace(NORTHSTAR, rules=rules)


def user_read(rid: str = "r-1") -> AdmitRequest:
    return AdmitRequest(request_id=rid, tenant_id="atlas", principal=Principal(type="user", id="U-17", api_key_id="K1"),
                        route_group="read")


def test_no_revocable_rule_selected_means_no_denial():
    assert revoked_decision(Snapshot(NORTHSTAR), user_read()) is None
    bundle = with_revocable("export-tenant")  # revocable, but not selected for a read
    assert revoked_decision(Snapshot(bundle), user_read()) is None


def test_a_selected_revocable_rule_denies_with_503_policy_stale():
    bundle = with_revocable("tenant-atlas-minute")
    rule = next(r for r in bundle.rules if r.id == "tenant-atlas-minute")
    m = AgentMetrics()
    d = revoked_decision(Snapshot(bundle), user_read("r-9"), m)
    assert d is not None and not d.allowed
    assert (d.decision_id, d.rule_id, d.denied_scope, d.reason) == ("r-9", rule.id, DeniedScope.TENANT,
                                                                       Reason.POLICY_STALE)
    assert (d.http_status, d.retry_after_ms) == (503, rule.closed_retry_after_ms)
    assert int(d.headers["Retry-After"]) >= rule.closed_retry_after_ms // 1000
    assert d.problem is not None and d.problem["decisionId"] == "r-9" and "older" in d.problem["detail"]
    assert m.registry.get_sample_value("leasehold_agent_decisions_total", {
        "outcome": "unavailable", "rule": rule.id, "policy_version": "42", "route_group": rule.route_key,
        "tenant": "atlas", "source": "policy"}) == 1


def test_an_anonymous_caller_learns_nothing_about_the_policy():
    bundle = with_revocable("anon-login")
    anon = AdmitRequest(request_id="r-2", principal=Principal(type="anonymous", id="203.0.113.9"),
                        route_group="login")
    d = revoked_decision(Snapshot(bundle), anon)
    assert d is not None and d.http_status == 503 and d.denied_scope is DeniedScope.IP
    assert d.rule_id is None and d.problem == {"type": "about:blank", "title": "Service Unavailable",
                                                 "status": 503}


def test_age_gauge_reads_the_watchers_age_in_seconds():
    class Watcher:
        def age_ms(self) -> float:
            return 2_500.0

    m = AgentMetrics()
    age_gauge(m, Watcher())
    assert m.registry.get_sample_value("leasehold_agent_policy_age_seconds") == 2.5


class _Stale:
    """A policy watch whose snapshot is past its maximum age."""

    def is_stale(self, bundle) -> bool:
        return True


def _state(bundle, tmp_path: Path):
    from types import SimpleNamespace

    from region_agent.decision.preauth import NewKeyCap
    from region_agent.service.policy import PolicyHolder
    from tests.support.clock import FakeClock

    return SimpleNamespace(policy_watch=_Stale(), holder=PolicyHolder(str(tmp_path / "none.json"), bundle), version_check=None,
                           metrics=AgentMetrics(), key_cap=NewKeyCap(per_source=1, window_ms=60_000,
                                                                     clock=FakeClock(1_000.0)))


def _gated_questions() -> list[AdmitRequest]:
    """One question per early answer: a revocable rule under a stale snapshot (r-1), the
    pre-authentication cap's first and second new address of one source (r-2, r-3), none (r-4)."""
    return [user_read("r-1"),
            AdmitRequest(request_id="r-2", principal=Principal(type="anonymous", id="203.0.1.1"), route_group="login"),
            AdmitRequest(request_id="r-3", principal=Principal(type="anonymous", id="203.0.2.2"), route_group="login"),
            AdmitRequest(request_id="r-4", tenant_id="birch", principal=Principal(type="user", id="U-1"),
                         route_group="search")]


def test_the_early_gates_of_one_question_are_those_of_a_batch(tmp_path):
    """Twins (docs/hot-path.md): ``pre_check`` (one question, no lists) and ``pre_decided`` (a
    batch) give every question the same early answer: a revocable rule under a stale snapshot,
    the pre-authentication cap (a second new address of one source), or none; a batch none of
    whose questions has one gets None in place of its list."""
    from region_agent.decision.admission import pre_check, pre_decided

    bundle = with_revocable("tenant-atlas-minute")
    questions = _gated_questions()
    one, many = _state(bundle, tmp_path), _state(bundle, tmp_path)
    singles = [pre_check(one, q) for q in questions]
    asked, early = pre_decided(many, questions)
    assert early is not None and list(zip(asked, early, strict=True)) == singles
    assert [d is not None and d.http_status for _, d in singles] == [503, False, 429, False]
    ungated = [questions[3]]  # no revocable rule, not anonymous
    alone = pre_check(_state(bundle, tmp_path), ungated[0])
    assert alone[1] is None and pre_decided(_state(bundle, tmp_path), ungated) == ([alone[0]], None)


async def test_a_single_admission_is_the_engines_own_coroutine_and_decides_as_a_list_of_one(tmp_path):
    """``Admission.decide_one`` without tracing runs the early gates at the call and hands back the
    engine's own coroutine (no admission frame around it); its decisions — the engine's, and the
    early gates' answers — are those ``decide`` gives a list of one, and an agent still starting
    raises the same error."""
    from types import SimpleNamespace

    import pytest

    from kernel.errors import Unavailable
    from region_agent.decision.admission import Admission
    from region_agent.models import Decision

    class Engine:
        def __init__(self):
            self.made: list = []

        def admit(self, req, *, decoded=False):
            async def admit():
                return Decision(allowed=True, decision_id=f"{req.request_id}/{decoded}", rule_id=None, bundle_version=1)
            self.made.append(admit())
            return self.made[-1]

    bundle = with_revocable("tenant-atlas-minute")
    questions = _gated_questions()
    one, many = _state(bundle, tmp_path), _state(bundle, tmp_path)
    one.engine, many.engine = Engine(), Engine()
    singles, lists = [], []
    for q in questions:
        aw = Admission(lambda: one).decide_one(q, door="http", decoded=True)
        if one.engine.made and aw is one.engine.made[-1]:  # the engine's coroutine itself
            one.engine.made.pop()
        singles.append(await aw)
        lists.extend(await Admission(lambda: many).decide([q], door="http", decoded=True))
    assert singles == lists
    assert [d.http_status for d in singles] == [503, 200, 429, 200] and not one.engine.made
    assert [d.decision_id for d in singles if d.http_status == 200] == ["r-2/True", "r-4/True"]
    starting = SimpleNamespace(engine=None)
    with pytest.raises(Unavailable):
        await Admission(lambda: starting).decide_one(questions[0], door="rls")
    with pytest.raises(Unavailable):
        await Admission(lambda: starting).decide([questions[0]], door="rls")


async def test_a_group_is_decided_as_each_question_alone_whatever_the_early_gates_answer(tmp_path):
    """Twins: ``Admission.decide`` of several questions (the early gates over the list, the
    engine's ``admit_many`` of the rest, the answers merged back in order; the engine's list as it
    is when no gate answered) and ``decide_one`` of each: the same decisions, the engine asked
    for the same questions, the same pre-authentication counts; a stale snapshot, the key cap, both
    or neither."""
    from region_agent.decision.admission import Admission
    from region_agent.models import Decision

    class Engine:
        def __init__(self):
            self.asked: list = []

        async def admit(self, req, *, decoded=False):
            self.asked.append(req.request_id)
            return Decision(allowed=True, decision_id=f"{req.request_id}/{decoded}", rule_id=None, bundle_version=1)

        async def admit_many(self, reqs, *, decoded=False):
            return [await self.admit(r, decoded=decoded) for r in reqs]

    bundle = with_revocable("tenant-atlas-minute")
    questions = [*_gated_questions(), AdmitRequest(request_id="r-5", tenant_id="birch",
                                                   principal=Principal(type="user", id="U-2"), route_group="search")]
    statuses = {(True, True): [503, 200, 429, 200, 200], (True, False): [503, 200, 200, 200, 200],
                (False, True): [200, 200, 429, 200, 200], (False, False): [200] * 5}
    for (stale, capped), expected in statuses.items():
        for asked in (questions, questions[3:], questions[:1] + questions[2:3]):
            one, many = _state(bundle, tmp_path), _state(bundle, tmp_path)
            for st in (one, many):
                st.engine = Engine()
                st.policy_watch = _Stale() if stale else None
                st.key_cap = st.key_cap if capped else None
            singles = [await Admission(lambda one=one: one).decide_one(q, door="rls", decoded=True) for q in asked]
            together = await Admission(lambda many=many: many).decide(asked, door="rls", decoded=True)
            assert together == singles and many.engine.asked == one.engine.asked
            assert _samples(many.metrics) == _samples(one.metrics)
            if asked is questions:
                assert [d.http_status for d in together] == expected


def _samples(m: AgentMetrics) -> list[str]:
    """Every sample of the agent's own metrics but the creation times."""
    from prometheus_client import generate_latest

    return [line for line in generate_latest(m.registry).decode().splitlines()
            if line.startswith("leasehold_") and "_created" not in line]
