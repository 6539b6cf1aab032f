"""Rule selection and effective cost -> the script calls of one decision (pure)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kernel.bundle import Bundle, Pool, load_bundle_file, make_rule, seal
from kernel.errors import ValidationFailed
from kernel.ids import is_id_text
from region_agent.decision.keys import KeyBuilder, hash_tag
from region_agent.decision.plan import Snapshot, build_plan, cc_keys_for_release
from region_agent.models import AdmitRequest, Principal

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
KB = KeyBuilder(b"unit-pepper")



def req(rid="r-9f3a61c2e07b4d18", tenant="atlas", ptype="user", pid="U-17", route="read", cost=1, key="K1"):
    return AdmitRequest(request_id=rid, tenant_id=tenant, principal=Principal(type=ptype, id=pid, api_key_id=key),
                        route_group=route, cost_hint=cost)


def test_read_request_user_then_tenant_with_effective_cost():
    plan = build_plan(Snapshot(NORTHSTAR), req(cost=3), KB)
    assert [r.id for r in plan.rules] == ["read-user-v3", "tenant-atlas-minute"]
    assert [c.kind for c in plan.calls] == ["tb", "tb"]
    assert plan.calls[0].params == (20_000, 2_000, 1_000, 3_000, 0)
    assert plan.calls[1].params == (1_000_000, 1_000_000, 60_000, 3_000, 0)
    assert plan.decision_ttl_ms == 0 and plan.slack_ms == 5_000
    assert {hash_tag(c.key) for c in plan.calls} | {hash_tag(plan.decision_key)} == {"t:atlas"}


def test_export_concurrency_gate_first_and_decision_record():
    plan = build_plan(Snapshot(NORTHSTAR), req(route="export", cost=2), KB)
    assert [(s.rule.id, s.role) for s in plan.slots] == [("export-tenant", "cc"), ("export-tenant", "rate"),
                                                         ("tenant-atlas-minute", "rate")]
    assert plan.calls[0].key == "rl:v3:{t:atlas}:tenant:atlas:export:cc"
    assert plan.calls[0].params == (3, 60_000, 0, 0, 0)
    assert plan.calls[1].params[3] == 20_000  # costMillis 10,000 x costHint 2
    assert plan.decision_ttl_ms == 30_000


def test_a_decision_record_question_names_tenant_principal_route_and_cost():
    base = build_plan(Snapshot(NORTHSTAR), req(route="export"), KB)
    assert len(base.question) == 16 and base.question.isalnum()
    assert build_plan(Snapshot(NORTHSTAR), req(route="export", rid="r-other-000001"), KB).question == base.question
    others = [req(route="export", tenant="birch"), req(route="export", pid="U-18"), req(route="export", key="K2"),
              req(route="export", key=None), req(route="export", cost=2), req(route="export", ptype="service")]
    assert len({build_plan(Snapshot(NORTHSTAR), r, KB).question for r in others} | {base.question}) == len(others) + 1
    assert KeyBuilder(b"other-pepper").question(tenant="atlas", principal_type="user", principal_id="U-17",
                                                api_key_id="K1", route_group="export", cost_hint=1) != base.question
    assert build_plan(Snapshot(NORTHSTAR), req(), KB).question == ""  # no record, no question


def test_birch_gets_its_own_tenant_rule_and_other_tenants_none():
    assert [r.id for r in build_plan(Snapshot(NORTHSTAR), req(tenant="birch"), KB).rules] == ["read-user-v3",
                                                                                  "tenant-birch-minute"]
    assert [r.id for r in build_plan(Snapshot(NORTHSTAR), req(tenant="cedar"), KB).rules] == ["read-user-v3"]
    assert build_plan(Snapshot(NORTHSTAR), req(tenant="cedar", route="search"), KB).calls == []


def test_anonymous_window_cost_in_units_and_ip_tag():
    plan = build_plan(Snapshot(NORTHSTAR), req(tenant=None, ptype="anonymous", pid="203.0.113.9", route="login", cost=2,
                                     key=None), KB)
    # the route's own window, then the every-route one (edge-ip), in one call under one ip tag
    assert [r.id for r in plan.rules] == ["anon-login", "edge-ip"]
    assert plan.calls[0].kind == "fw" and plan.calls[0].params == (20, 10_000, 2, 0, 0)
    assert plan.calls[1].kind == "fw" and plan.calls[1].params == (1_000, 10_000, 2, 0, 0)
    assert hash_tag(plan.calls[0].key) == hash_tag(plan.calls[1].key) == hash_tag(plan.decision_key)
    assert hash_tag(plan.decision_key).startswith("ip:")
    assert plan.anonymous and plan.edge is None


def test_an_authenticated_request_with_its_address_spends_the_every_request_window_first():
    """ip rules marked everyRequest are the pre-authentication stage of every request: with the
    caller's address, an authenticated plan carries them as its edge plan (their own call: the
    ip hash tag), at cost 1 whatever the request's weight; without the address it has none."""
    with_ip = msgspec.structs.replace(req(route="read", cost=3), client_ip="203.0.113.9")
    plan = build_plan(Snapshot(NORTHSTAR), with_ip, KB)
    assert [r.id for r in plan.rules] == ["read-user-v3", "tenant-atlas-minute"]
    assert plan.edge is not None and plan.edge.anonymous and [r.id for r in plan.edge.rules] == ["edge-ip"]
    assert plan.edge.calls[0].params == (1_000, 10_000, 1, 0, 0) and plan.edge.request_id == plan.request_id
    assert hash_tag(plan.edge.calls[0].key).startswith("ip:") and hash_tag(plan.calls[0].key) == "t:atlas"
    # the same key an anonymous request from that address spends (failed authentications count there)
    anon = build_plan(Snapshot(NORTHSTAR), req(tenant=None, ptype="anonymous", pid="203.0.113.9", route="read", key=None), KB)
    assert [c.key for c in anon.calls] == [plan.edge.calls[0].key]
    assert build_plan(Snapshot(NORTHSTAR), req(route="read"), KB).edge is None


def test_identity_errors_are_validation_failures():
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(tenant=None), KB)  # tenant required for users
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(tenant=None, ptype="anonymous", pid="nope", route="login", key=None), KB)
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(rid="abcdefgh\n"), KB)
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(tenant="atlas\n"), KB)


def test_shadow_rules_and_pools():
    pools = [Pool(id="p-global", window_ms=60_000, limit=40_000), Pool(id="p-atlas", window_ms=60_000, limit=500)]
    extra = [
        make_rule(id="shadow-route", scope="route", route_group="read", algorithm="sliding_log", limit=5, window_ms=1_000,
             fail_mode="open", shadow=True),
        make_rule(id="global-read", scope="global", route_group="read", algorithm="pool", pool="p-global", cost=2,
             fail_mode="closed"),
        make_rule(id="atlas-pool", scope="tenant", tenant="atlas", route_group="read", algorithm="pool", pool="p-atlas",
             fail_mode="closed"),
    ]
    b = seal(msgspec.structs.replace(NORTHSTAR, rules=[*NORTHSTAR.rules, *extra], pools=pools))
    plan = build_plan(Snapshot(b), req(cost=3), KB)
    assert [s.rule.id for s in plan.shadow_slots] == ["shadow-route"]
    assert plan.shadow_calls[0].kind == "sl" and plan.shadow_calls[0].params == (5, 1_000, 3, 0, 0)
    assert [(g.rule.id, g.cost) for g in plan.global_spends] == [("global-read", 6)]
    pool_call = next(c for c, s in zip(plan.calls, plan.slots, strict=True) if s.role == "pool")
    assert pool_call.key == "rl:v3:{t:atlas}:pool:p-atlas" and pool_call.params == (3, 0, 0, 0, 0)
    assert "global-read" in [r.id for r in plan.rules] and all(s.rule.id != "global-read" for s in plan.slots)


def test_release_names_the_same_gates():
    keys = cc_keys_for_release(Snapshot(NORTHSTAR), request_tenant="atlas", principal=Principal(type="user", id="U-17"),
                               route_group="export", keys=KB)
    assert keys == [build_plan(Snapshot(NORTHSTAR), req(route="export"), KB).calls[0].key]
    assert cc_keys_for_release(Snapshot(NORTHSTAR), request_tenant="atlas", principal=Principal(type="user", id="U-17"),
                               route_group="read", keys=KB) == []


def test_reported_units():
    read = NORTHSTAR.rules[0]
    anon = next(r for r in NORTHSTAR.rules if r.id == "anon-login")
    assert read.limit_tokens({}) == 20 and read.remaining_tokens(19_999) == 19 and read.remaining_tokens(-5) == 0
    assert anon.limit_tokens({}) == 20 and anon.remaining_tokens(7) == 7


def test_bundle_type_is_the_contract_one():
    assert isinstance(NORTHSTAR, Bundle) and NORTHSTAR.bundle_version == 42


# --- properties over arbitrary requests --------------------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ID_TEXTS = st.text(min_size=1, max_size=64).filter(is_id_text)  # what a Principal's ids may be

TENANTS = st.one_of(st.sampled_from(["atlas", "birch", "cedar"]), st.from_regex(r"[a-z0-9-]{1,32}", fullmatch=True))
ROUTES = st.one_of(st.sampled_from(["read", "export", "login", "search"]),
                   st.from_regex(r"[a-z0-9_-]{1,32}", fullmatch=True))
IPS = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))


@settings(max_examples=150, deadline=None)
@given(tenant=TENANTS, route=ROUTES, ptype=st.sampled_from(["user", "service", "anonymous"]),
       pid=ID_TEXTS, ip=IPS, key=st.one_of(st.none(), ID_TEXTS),
       cost=st.integers(1, 1000))
def test_every_plan_stays_in_one_slot_and_within_bounds(tenant, route, ptype, pid, ip, key, cost):
    r = AdmitRequest(request_id="prop-0000001", tenant_id=None if ptype == "anonymous" else tenant,
                     principal=Principal(type=ptype, id=ip if ptype == "anonymous" else pid, api_key_id=key),
                     route_group=route, cost_hint=cost)
    plan = build_plan(Snapshot(NORTHSTAR), r, KB)
    keys = [c.key for c in plan.calls] + [plan.decision_key]
    assert len({hash_tag(k) for k in keys}) == 1  # one script, one slot
    assert len(plan.calls) <= 8 and len(set(keys)) == len(keys)  # no key listed twice
    for k in keys:
        parts = k.split(":")
        if parts[4] == "u":  # the principal appears only as its keyed hash
            assert parts[5] == KB.h(tenant, "u", pid)
        assert "\n" not in k and " " not in k
    for c, s in zip(plan.calls, plan.slots, strict=True):
        if c.kind == "tb":
            assert c.params[3] == (s.rule.cost_millis or 0) * cost
        elif c.kind in ("fw", "sc", "sl"):
            assert c.params[2] == cost


# --- the per-snapshot precomputation (Shape: key templates, slot parameters) -------------------
GLOBAL = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar-global.json"))


@settings(max_examples=200, deadline=None)
@given(tenant=TENANTS, route=ROUTES, ptype=st.sampled_from(["user", "service"]),
       pid=ID_TEXTS, key=st.one_of(st.none(), ID_TEXTS),
       bundle=st.sampled_from([NORTHSTAR, GLOBAL]))
def test_key_templates_complete_to_the_keys_rule_key_derives(tenant, route, ptype, pid, key, bundle):
    """Differential: a template completed per request (KeyBuilder.key_from) is the key KeyBuilder.rule_key
    derives from the request, and raises where rule_key raises."""
    user_id = pid if ptype == "user" else None
    for rule in bundle.rules:
        t = KeyBuilder.template(rule, tenant)
        if rule.pool_id is not None:
            assert t is not None and t.tail == KB.tenant_pool_key(tenant, rule.pool_id)
            continue
        if rule.scope in ("ip", "global"):
            assert t is None
            continue
        try:
            want: str | type = KB.rule_key(rule, tenant=tenant, user_id=user_id, api_key_id=key, route_group=route)
        except ValidationFailed:
            want = ValidationFailed
        try:
            got: str | type = KB.key_from(t, tenant, user_id, key)
        except ValidationFailed:
            got = ValidationFailed
        assert got == want
    assert KeyBuilder.template(bundle.rules[0], None) is None


@settings(max_examples=150, deadline=None)
@given(tenant=TENANTS, route=ROUTES, ptype=st.sampled_from(["user", "service", "anonymous"]),
       pid=ID_TEXTS, ip=IPS, key=st.one_of(st.none(), ID_TEXTS),
       cost=st.integers(1, 1000), bundle=st.sampled_from([NORTHSTAR, GLOBAL]))
def test_prechecked_call_is_the_checked_call(tenant, route, ptype, pid, ip, key, cost, bundle):
    """The tenant call built from the shape's once-checked ARGV equals multi_rule_call's, and a
    request whose slots would be refused is refused the same way."""
    from region_agent.decision.call import multi_rule_call, prechecked_call

    r = AdmitRequest(request_id="prop-0000002", tenant_id=None if ptype == "anonymous" else tenant,
                     principal=Principal(type=ptype, id=ip if ptype == "anonymous" else pid, api_key_id=key),
                     route_group=route, cost_hint=cost)
    try:
        plan = build_plan(Snapshot(bundle), r, KB)
    except ValidationFailed:
        return
    if not plan.calls:
        return
    want = multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                           decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id, question=plan.question)
    assert plan.argv_rules is not None
    assert prechecked_call(plan.calls, plan.argv_rules, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                           decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id,
                           question=plan.question) == want
    assert plan.rule_keys == {s.rule.id: c.key for s, c in zip(plan.slots, plan.calls, strict=True) if s.role != "cc"}


def test_a_decoded_request_skips_only_the_pattern_checks_it_already_passed():
    """The identity fields are checked once: by the wire decoder, or here for a request built in
    process; a decoded request keeps only the checks no wire type makes (a tenant for a user, an
    anonymous caller's address)."""
    for bad in (req(rid="abcdefgh\n"), req(tenant="atlas\n"), req(route="Read")):
        with pytest.raises(ValidationFailed):
            build_plan(Snapshot(NORTHSTAR), bad, KB)
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(tenant=None), KB, checked=True)
    with pytest.raises(ValidationFailed):
        build_plan(Snapshot(NORTHSTAR), req(tenant=None, ptype="anonymous", pid="nope", route="login", key=None), KB,
                   checked=True)
    assert build_plan(Snapshot(NORTHSTAR), req(), KB, checked=True).calls == build_plan(Snapshot(NORTHSTAR), req(), KB).calls


def test_duplicate_keys_are_refused_by_the_prechecked_call_too():
    from kernel.errors import ScriptRejected
    from region_agent.decision.call import Call, prechecked_call

    calls = [Call("k1", "tb", (1, 1, 1, 1, 0)), Call("k1", "tb", (1, 1, 1, 1, 0))]
    with pytest.raises(ScriptRejected):
        prechecked_call(calls, ("tb", 1, 1, 1, 1, 0, "tb", 1, 1, 1, 1, 0), decision_key="d", slack_ms=0,
                        decision_ttl_ms=0, member="m")


# --- the per-question memo (Snapshot.keyed) ----------------------------------------------------
def _fields(plan):
    return (plan.request_id, plan.tenant, plan.principal_type, [r.id for r in plan.rules], plan.calls,
            list(plan.shadow_calls), list(plan.global_spends), plan.decision_key, plan.decision_ttl_ms, plan.question,
            plan.slack_ms, plan.cost_hint, plan.argv_rules, plan.has_pool, list(plan.approx),
            None if plan.edge is None else _fields(plan.edge))


def test_a_remembered_plan_is_the_plan_built_afresh_with_only_the_request_id_per_request():
    snap = Snapshot(NORTHSTAR)
    asks = [req(rid=f"r-{i:012d}", route=route, ptype=ptype, pid=pid, tenant=tenant, key=None)
            for i, (route, ptype, pid, tenant) in enumerate([
                ("read", "user", "U-1", "atlas"), ("export", "user", "U-1", "atlas"),
                ("login", "anonymous", "203.0.113.9", None), ("read", "user", "U-2", "birch")])]
    for r in asks:
        first = build_plan(snap, r, KB, checked=True)  # asked once: not remembered yet
        assert len(snap.keyed) == asks.index(r)
        again = build_plan(snap, r, KB, checked=True)  # asked again: remembered
        other = build_plan(snap, msgspec.structs.replace(r, request_id=r.request_id + "x"), KB, checked=True)
        fresh = build_plan(Snapshot(NORTHSTAR), r, KB, checked=True)
        assert _fields(first) == _fields(again) == _fields(fresh)
        assert other.calls is again.calls and other.denial_keys is again.denial_keys  # the question's part is shared
        assert other.request_id != first.request_id  # ... the request id is not
        if first.decision_ttl_ms > 0:  # a recorded decision's key is the request's own
            assert other.decision_key != first.decision_key and other.question == first.question
    assert len(snap.keyed) == len(asks)


def test_a_remembered_questions_call_is_the_call_built_afresh_and_packs_as_redis_py_would():
    """A remembered question's tenant call (its KEYS checked and script named once, its text around
    the request's own strings made once per script sha: call.CallText, store.resp) is the call
    built per request, and packs to the bytes redis-py's packer sends for it, for a decision key
    the question shares and for a recorded decision's own; the question asked once has none."""
    from redis.asyncio.connection import Connection

    from region_agent.decision.call import multi_rule_call, plan_calls
    from region_agent.store.resp import pack_evalsha, pack_pipeline

    snap = Snapshot(NORTHSTAR)
    sha = "0123456789abcdef0123456789abcdef01234567"
    kinds = set()
    for route, ptype, pid, tenant in [("read", "user", "U-1", "atlas"), ("export", "user", "U-1", "atlas"),
                                      ("login", "anonymous", "203.0.113.9", None), ("read", "user", "U-2", "birch")]:
        for i in range(4):
            r = req(rid=f"r-{route}-{i:08d}", route=route, ptype=ptype, pid=pid, tenant=tenant, key=None)
            plan = build_plan(snap, r, KB, checked=True)
            assert (plan.text is None) == (i == 0)  # remembered from the second asking
            (call,) = plan_calls(plan)
            want = multi_rule_call(plan.calls, decision_key=plan.decision_key, slack_ms=plan.slack_ms,
                                   decision_ttl_ms=plan.decision_ttl_ms, member=plan.request_id, question=plan.question)
            assert call == want
            name, keys, argv = call
            expected = b"".join(Connection().pack_command("EVALSHA", sha, len(keys), *keys, *argv))
            assert pack_evalsha(sha, keys, argv) == expected
            assert pack_pipeline([(sha, keys, argv), (sha[::-1], keys, argv)]) == expected + b"".join(
                Connection().pack_command("EVALSHA", sha[::-1], len(keys), *keys, *argv))  # another sha: made again
            if plan.text is not None:
                kinds.add(plan.text.dk is None)
    assert kinds == {True, False}  # both a recorded decision's call and a shared decision key's were packed


def test_questions_that_differ_only_inside_free_text_ids_are_never_one():
    snap = Snapshot(NORTHSTAR)
    one = req(ptype="user", pid="U-1", key="K1:x")
    two = req(ptype="user", pid="U-1:K1", key="x")
    for _ in range(3):
        a, b = build_plan(snap, one, KB), build_plan(snap, two, KB)
        assert a.calls[0].key != b.calls[0].key
        assert a.calls == build_plan(Snapshot(NORTHSTAR), one, KB).calls


def test_the_memo_belongs_to_one_key_builder_and_keeps_no_refused_question():
    snap = Snapshot(NORTHSTAR)
    other_kb = KeyBuilder(b"another-pepper")
    for _ in range(2):
        a = build_plan(snap, req(), KB)
        b = build_plan(snap, req(), other_kb)  # another key builder: built per request, never from KB's memo
        assert a.calls[0].key != b.calls[0].key  # user keys carry the pepper's hash
        assert b.calls[0].key == build_plan(Snapshot(NORTHSTAR), req(), other_kb).calls[0].key
    assert snap.keyed_by is KB and len(snap.keyed) == 1
    for _ in range(3):  # an authenticated principal without a tenant: refused every time, never remembered
        with pytest.raises(ValidationFailed):
            build_plan(snap, req(tenant=None), KB)
    assert len(snap.keyed) == 1


def test_a_policy_reload_plans_with_the_new_bundle_never_a_remembered_plan():
    from region_agent.service.policy import PolicyHolder

    def version(n, burst):
        rules = [msgspec.structs.replace(r, capacity_millis=burst * 1000) if r.id == "read-user-v3" else r
                 for r in NORTHSTAR.rules]
        return seal(msgspec.structs.replace(NORTHSTAR, bundle_version=n, rules=rules))

    holder = PolicyHolder("unused.json", version(900, 20))
    old = holder.snapshot
    build_plan(old, req(), KB)
    before = build_plan(old, req(rid="r-another-0001"), KB)  # asked twice: remembered
    assert build_plan(holder.snapshot, req(rid="r-another-0002"), KB).calls is before.calls
    assert before.calls[0].params[0] == 20_000
    assert holder.offer(version(901, 35)).outcome == "accepted"
    assert holder.snapshot is not old and len(holder.snapshot.keyed) == 0  # a new snapshot: its own memo
    for i in range(3):  # first asked, then remembered, then answered from the memo: the new bundle's throughout
        after = build_plan(holder.snapshot, req(rid=f"r-after-{i:04d}"), KB)
        assert after.calls[0].params[0] == 35_000  # the new bundle's burst, not the remembered call
        assert after.calls[0].key == before.calls[0].key  # same question, same key
    assert build_plan(old, req(), KB).calls[0].params[0] == 20_000  # a reader still on the old snapshot
