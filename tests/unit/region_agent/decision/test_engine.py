"""The decision engine (region_agent/decision/engine.py) without a network: a store that answers what
each test scripts (the Store protocol), a manual clock, the sample policy. What the answer
means is region_agent.decision.outcome's (tests/unit/region_agent/decision/test_outcome.py); here: that the engine sends
the plan's call, carries the step out (negative cache, idempotent re-send, failMode) and
counts what it did. The real-Redis paths are tests/integration/region_agent/."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kernel.bundle import load_bundle_file
from kernel.errors import AmbiguousOutcome, NothingRan, Overloaded, ScriptRejected, StoreUnavailable
from region_agent.decision.engine import DecisionEngine
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.negcache import NegativeCache
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.leasing.book import BalanceState
from region_agent.leasing.window_clock import AllocatorClock
from region_agent.models import AdmitRequest, Principal, Reason
from region_agent.service.metrics import AgentMetrics
from tests.support.clock import FakeClock
from tests.support.scripted_store import ScriptedStore

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
SNAP = Snapshot(NORTHSTAR)


def engine(store: ScriptedStore, clock: FakeClock | None = None) -> tuple[DecisionEngine, AgentMetrics]:
    m = AgentMetrics()
    c = clock or FakeClock(1_000.0)
    return DecisionEngine(get_snapshot=lambda: SNAP, keys=KeyBuilder(b"unit-pepper"), store=store, metrics=m,
                          clock=c, wall_clock=lambda: c.t + 1.7e9, negative=NegativeCache()), m


def req(route="read", cost=1, rid="r-9f3a61c2e07b4d18", user="U-17"):
    return AdmitRequest(request_id=rid, tenant_id="atlas", principal=Principal(type="user", id=user, api_key_id="K1"),
                        route_group=route, cost_hint=cost)


def sample(m: AgentMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


async def test_allowed_sends_one_multi_rule_call_and_reports_the_first_rule():
    store = ScriptedStore([[1, 0, 0, 17_000, 900_000]])
    e, _ = engine(store)
    d = await e.admit(req())
    assert d.allowed and d.http_status == 200 and d.rule_id == "read-user-v3"
    assert (d.limit, d.remaining, d.fallback) == (20, 17, False)
    [[(script, keys, argv)]] = store.sent
    assert script == "multi_rule[tb]" and len(keys) == 3 and argv[3:5] == ["tb", 20_000]


async def test_a_denial_is_remembered_and_the_next_same_request_stays_off_the_store():
    store = ScriptedStore([[0, 2, 1_500, 20_000, 400]])
    e, m = engine(store)
    first = await e.admit(req())
    assert not first.allowed and first.reason == Reason.RATE_EXCEEDED and first.rule_id == "tenant-atlas-minute"
    assert first.http_status == 429 and first.retry_after_ms == 1_500
    again = await e.admit(req(rid="r-0000000000000002"))
    assert len(store.sent) == 1  # answered by the negative cache
    assert not again.allowed and again.rule_id == "tenant-atlas-minute" and again.retry_after_ms == 1_500
    assert sample(m, "leasehold_agent_negative_cache_hits_total") == 1


async def test_store_unreachable_local_bounded_rules_answer_from_their_fallback():
    e, m = engine(ScriptedStore(StoreUnavailable("down")))
    d = await e.admit(req())
    assert d.allowed and d.fallback and d.rule_id == "read-user-v3"
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="STORE_UNREACHABLE",
                  fail_mode="local_bounded") == 1


async def test_store_unreachable_a_closed_rule_answers_503():
    e, _ = engine(ScriptedStore(StoreUnavailable("down")))
    d = await e.admit(req(route="export"))
    assert not d.allowed and d.http_status == 503 and d.reason == Reason.LIMITER_UNAVAILABLE
    assert d.rule_id == "export-tenant" and not d.fallback


async def test_overload_is_shed_never_answered_from_the_fallback():
    e, m = engine(ScriptedStore(Overloaded("queue full", extra={"reason": "QUEUE_FULL"})))
    d = await e.admit(req())
    assert not d.allowed and d.reason == Reason.OVERLOADED and d.http_status == 503 and not d.fallback
    assert sample(m, "leasehold_agent_queue_rejections_total") == 1


async def test_an_ambiguous_idempotent_decision_is_sent_once_more_and_its_record_answers():
    store = ScriptedStore(AmbiguousOutcome("reply lost"), [[1, 0, 0, 2, 9_000, 900_000]])
    e, _ = engine(store)
    d = await e.admit(req(route="export", cost=2))
    assert d.allowed and not d.fallback
    assert len(store.sent) == 2 and store.sent[0] == store.sent[1]  # the same call: the record replays it


async def test_an_ambiguous_cheap_read_degrades_without_a_second_send():
    store = ScriptedStore(AmbiguousOutcome("reply lost"))
    e, _ = engine(store)
    d = await e.admit(req())
    assert d.allowed and d.fallback and len(store.sent) == 1


@pytest.mark.parametrize("in_place", [True, False], ids=["reply", "raised"])
@pytest.mark.parametrize(("route", "reply"), [("read", [1, 0, 0, 19_000, 999_000]),  # no decision record
                                              ("export", [1, 0, 0, 2, 9_000, 900_000])])  # a decision record
async def test_a_call_that_did_not_run_is_sent_once_more_with_or_without_a_record(route, reply, in_place):
    """NothingRan (NOSCRIPT, then the reload lost its connection): not ambiguous, so the same
    call goes again within the budget whatever the rules, and is counted as what it was."""
    failed = NothingRan("reload lost")
    store = ScriptedStore([failed] if in_place else failed, [reply])
    e, m = engine(store)
    d = await e.admit(req(route=route, cost=2 if route == "export" else 1))
    assert d.allowed and not d.fallback and d.http_status == 200
    assert len(store.sent) == 2 and store.sent[0][0] == store.sent[1][0]
    assert sample(m, "leasehold_agent_script_errors_total", error="NothingRan") == 1
    assert sample(m, "leasehold_agent_script_errors_total", error="AmbiguousOutcome") == 0


@pytest.mark.parametrize(("route", "fallback", "status"), [("read", True, 200), ("export", False, 503)])
async def test_a_call_that_did_not_run_twice_degrades_as_the_store_unreachable(route, fallback, status):
    """Sent again once only: a second NothingRan degrades per failMode, labelled as the store
    unreachable (never AMBIGUOUS)."""
    store = ScriptedStore(NothingRan("reload lost"), NothingRan("reload lost"))
    e, m = engine(store)
    d = await e.admit(req(route=route))
    assert len(store.sent) == 2 and (d.fallback, d.http_status) == (fallback, status)
    mode = "local_bounded" if fallback else "closed"
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="STORE_UNREACHABLE", fail_mode=mode) == 1
    assert sample(m, "leasehold_agent_degraded_decisions_total", reason="AMBIGUOUS", fail_mode=mode) == 0


async def test_a_decision_record_of_another_question_is_a_conflict_decision_not_an_error():
    """The engine answers a conflict like any question (one admission for every door: only the
    HTTP door makes it a 409; the rate limit service an OVER_LIMIT)."""
    e, _ = engine(ScriptedStore([[-1, 0, 0, 0, 0, 0]]))
    d = await e.admit(req(route="export"))
    assert (d.allowed, d.reason, d.http_status, d.retry_after_ms) == (False, Reason.REQUEST_ID_CONFLICT, 409, -1)
    assert d.problem is not None and d.problem["type"].endswith("/decision-conflict")


async def test_a_batch_sends_every_item_in_one_submit():
    store = ScriptedStore([[1, 0, 0, 19_000, 999_000], [0, 1, 500, 0, 999_000]])
    e, _ = engine(store)
    out = await e.admit_many([req(rid="r-0000000000000001"), req(rid="r-0000000000000002")])
    assert [d.allowed for d in out] == [True, False] and len(store.sent) == 1 and len(store.sent[0]) == 2


async def test_a_batch_decides_each_item_as_a_single_admission_would():
    """Twins (docs/hot-path.md): ``admit_many`` (one submit for every item, each item completed
    without a coroutine where it can) and ``admit`` (one request) give the same record for the
    same question and the same store reply: an admission, a denial, a conflict."""
    questions = [req(rid="r-0000000000000001", user="U-1"), req(rid="r-0000000000000002", user="U-2"),
                 req(rid="r-0000000000000003", user="U-3", route="export"), req(rid="r-0000000000000004", user="U-4")]
    replies = [[1, 0, 0, 19_000, 999_000], [0, 1, 500, 0, 999_000], [-1, 0, 0, 0], [0, 2, 1_500, 20_000, 400]]
    single, _ = engine(ScriptedStore(*[[r] for r in replies]))
    one_by_one = [await single.admit(q) for q in questions]
    batched, _ = engine(ScriptedStore(replies))
    together = await batched.admit_many(questions)
    assert together == one_by_one
    assert [d.http_status for d in together] == [200, 429, 409, 429]  # (the tenant's denial last: the
    # single path holds it for the requests after it, which a batch decided in the same instant cannot)


@pytest.mark.parametrize("failure", ["submit", "calls"])
async def test_a_batch_whose_calls_fail_decides_each_item_as_a_single_admission_would(failure, monkeypatch):
    """Twins again, when calls fail: the batch's submit fails (every item that sent calls gets its
    error, as each alone would from its own submit) or one item's calls cannot be built (that item
    is decided with the error, as one whose submit raised it alone; the others get their own
    replies, in order); an item the negative cache answers sends nothing in either."""
    import region_agent.decision.engine as engine_module

    built = engine_module.plan_calls
    refused = ScriptRejected("nine slots")

    def refusing(plan):
        calls = built(plan)
        if failure == "calls" and calls and "r-0000000000000002" in str(calls[0]):
            raise refused
        return calls

    monkeypatch.setattr(engine_module, "plan_calls", refusing)
    questions = [req(rid="r-0000000000000001", user="U-1"), req(rid="r-0000000000000002", user="U-2"),
                 req(rid="r-0000000000000003", user="U-3", route="export"),
                 req(rid="r-0000000000000004", user="U-9"), req(rid="r-0000000000000005", user="U-4")]
    denial = [0, 1, 500, 0, 999_000]  # U-9's own key denied first: the negative cache answers it after
    down = StoreUnavailable("down")
    replies = [[1, 0, 0, 19_000, 999_000], [1, 0, 0, 2, 9_000, 900_000], [1, 0, 0, 18_000, 999_000]]
    if failure == "submit":
        singles, batch = [[denial], down, down, down, down], [[denial], down]
    else:  # (U-2's single decision: its own engine, its submit raising the error)
        singles, batch = [[denial], [replies[0]], [replies[1]], [replies[2]]], [[denial], replies]

    async def decide(scripts, many: bool):
        store = ScriptedStore(*scripts)
        e, m = engine(store)
        assert not (await e.admit(req(rid="r-0000000000000000", user="U-9"))).allowed
        if many:
            return await e.admit_many(questions), store
        asked = questions if failure == "submit" else questions[:1] + questions[2:]
        return [await e.admit(q) for q in asked], store

    one_by_one, _ = await decide(singles, False)
    together, store = await decide(batch, True)
    assert len(store.sent) == 2 and len(store.sent[1]) == (4 if failure == "submit" else 3)
    assert together[3].source.value == "negative_cache"
    if failure == "calls":
        alone, _ = engine(ScriptedStore(refused))
        one_by_one.insert(1, await alone.admit(questions[1]))
        assert together[1].fallback and not any(d.fallback for d in together[:1] + together[2:])
    assert together == one_by_one


async def test_an_exact_hint_is_held_whole_and_an_admitted_probe_clears_the_denial():
    store = ScriptedStore([[0, 2, 1_500, 20_000, 400]], [[1, 0, 0, 19_000, 1_000]], [[1, 0, 0, 18_000, 999]])
    clock = FakeClock(1_000.0)
    e, _ = engine(store, clock)
    assert not (await e.admit(req(rid="r-0000000000000001"))).allowed
    clock.t += 1.0  # a bucket's hint is exact: held for the whole 1.5 s, not the 250 ms cap
    assert not (await e.admit(req(rid="r-0000000000000002"))).allowed and len(store.sent) == 1
    clock.t += 0.6  # the hold is over: this caller probes, and is admitted
    assert (await e.admit(req(rid="r-0000000000000003"))).allowed and len(store.sent) == 2
    assert (await e.admit(req(rid="r-0000000000000004"))).allowed and len(store.sent) == 3  # nothing held


# ------------------------------------------------------------------ a leased tenant pool's waits
GLOBAL = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))


class _Leases:
    """A lease manager whose top-up in flight has just ended and whose balance holds the next
    window's lease, starting in a moment (a rollover)."""

    def __init__(self):
        self.clock = AllocatorClock()
        self.starts: list[int] = []

    def on_refill(self, listener):
        pass

    def note(self, pool, key, tokens):
        pass

    def cold(self, key):
        return False

    def observed(self, key, spendable, starts_in_ms=0, within_ms=0.0):
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)  # the top-up in flight ended (it took the next window's lease)
        return done

    def lease_start(self, key, starts_in_ms):
        self.starts.append(starts_in_ms)
        started = asyncio.get_running_loop().create_future()
        started.set_result(None)
        return started

    def state(self, key):
        return BalanceState.OK

    def retry_hint_ms(self, key):
        return 590


async def test_after_waiting_for_a_top_up_a_lease_starting_within_the_budget_is_waited_for():
    """The balance ran dry, the decision waited for the top-up in flight, and the script then finds
    the lease it brought (the next window's) starting in 300 ms: with budget left for that, the
    decision waits for its start and asks again (admitted), instead of a 429 for a pool with plenty."""
    snap = Snapshot(GLOBAL)
    c = FakeClock(1_000.0)
    leases = _Leases()
    r = AdmitRequest(request_id="r-9f3a61c2e07b4d18", tenant_id="atlas",
                     principal=Principal(type="user", id="U-17", api_key_id="K1"), route_group="write", cost_hint=1)
    plan_slots = build_plan(snap, r, KeyBuilder(b"unit-pepper")).slots
    idx = next(i for i, s in enumerate(plan_slots) if s.rule.id == "tenant-atlas-global")
    zeros = [0] * len(plan_slots)
    store = ScriptedStore([[0, idx + 1, 0, *zeros]], [[0, idx + 1, 300, *zeros]],
                          [[1, 0, 0, *[500 for _ in plan_slots]]])
    m = AgentMetrics()
    e = DecisionEngine(get_snapshot=lambda: snap, keys=KeyBuilder(b"unit-pepper"), store=store, metrics=m,
                       clock=c, wall_clock=lambda: c.t + 1.7e9, negative=NegativeCache(), leases=leases,
                       budget_ms=5_000)
    d = await e.admit(r)
    assert d.allowed, d
    assert len(store.sent) == 3 and leases.starts == [300]
    assert sample(m, "leasehold_agent_pool_waits_total", pool="atlas-minute") == 2
