"""Bundle validation cases (docs/policy.md), through the agent's loading and reload path (files only)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kernel.bundle import (
    Bundle,
    Fallback,
    Pool,
    Rule,
    decode_bundle,
    encode_bundle,
    load_bundle_file,
    make_rule,
    seal,
)
from kernel.errors import PolicyError
from region_agent.service.policy import PolicyHolder

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))


def tb(id: str, **kw) -> Rule:
    base = dict(id=id, scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
                refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="open")
    base.update(kw)
    return make_rule(**base)


def sealed(rules, **kw) -> bytes:
    return encode_bundle(seal(Bundle(bundle_version=kw.pop("version", 1), published_at="2026-11-06T09:30:00Z",
                                     checksum="", rules=rules, **kw)))


def problems(raw: bytes) -> list[str]:
    with pytest.raises(PolicyError) as e:
        decode_bundle(raw)
    return e.value.errors


def test_northstar_is_valid_and_sealed():
    assert NORTHSTAR.bundle_version == 42
    assert decode_bundle(encode_bundle(NORTHSTAR)) == NORTHSTAR


def test_cost_above_capacity():
    assert any("exceeds capacityMillis" in p for p in problems(sealed([tb("a", cost_millis=30_000)])))


def test_refill_zero_and_out_of_bounds_integers():
    raw = sealed([tb("a")]).replace(b'"refillMillis": 2000', b'"refillMillis": 0')
    assert problems(raw)
    raw = sealed([tb("a")]).replace(b'"capacityMillis": 20000', b'"capacityMillis": 1099511627777')
    assert problems(raw)
    raw = sealed([tb("a")]).replace(b'"capacityMillis": 20000', b'"capacityMillis": 20000.5')
    assert problems(raw)
    assert any("2^52" in p for p in problems(sealed([tb("a", capacity_millis=2**40, period_ms=2**20,
                                                         cost_millis=1)])))


def test_duplicate_keys_and_ids():
    ps = problems(sealed([tb("a"), tb("b")]))
    assert any("name the same key" in p for p in ps)
    assert any("used twice" in p for p in problems(sealed([tb("a"), tb("a", route_group="export")])))


def test_missing_fail_mode():
    assert any("failMode is required" in p for p in problems(sealed([tb("a", fail_mode=None)])))
    assert any("fallback" in p for p in problems(sealed([tb("a", fail_mode="local_bounded")])))


def test_cross_slot_global_rule_is_rejected():
    ps = problems(sealed([tb("a"), tb("g", scope="global")]))
    assert any("cross hash slots" in p for p in ps)


def test_too_many_rules_for_one_request():
    many = [tb(f"{scope}-{route or 'all'}", scope=scope, route_group=route)
            for scope in ("user", "key", "route", "tenant") for route in ("read", None)]
    assert len(decode_bundle(sealed(many)).rules) == 8  # eight for a keyed user's read: accepted
    ninth = make_rule(id="pool-read", scope="global", route_group="read", algorithm="pool", pool="p", fail_mode="closed")
    ps = problems(sealed([*many, ninth], pools=[Pool(id="p", window_ms=60_000, limit=100)]))
    assert any("at most 8" in p for p in ps)


def test_catch_all_exemption_is_rejected_and_owned_exemption_accepted():
    assert any("catch-all" in p for p in problems(sealed([tb("x", exempt=True, owner="ops")])))
    assert any("owner" in p for p in problems(sealed([tb("x", exempt=True, tenant="atlas")])))
    decode_bundle(sealed([tb("x", exempt=True, tenant="atlas", owner="ops", fail_mode="closed")]))


def test_an_exempt_rule_never_fails_open_is_never_shadow_and_names_a_plain_owner():
    """I14: a bypass that fails open is unmetered while the store is down; a shadow exempt rule
    would replace the tenant's rules by nothing enforced; the owner goes into audit events."""
    assert any("cannot fail open" in p for p in problems(sealed([tb("x", exempt=True, tenant="atlas", owner="ops")])))
    assert any("shadow" in p for p in problems(sealed([tb("x", exempt=True, tenant="atlas", owner="ops",
                                                          fail_mode="closed", shadow=True)])))
    assert any("owner must match" in p for p in problems(sealed([tb("x", exempt=True, tenant="atlas",
                                                                     owner="ops team\n", fail_mode="closed")])))


def test_bad_checksum():
    raw = sealed([tb("a")]).replace(b'"costMillis": 1000', b'"costMillis": 2000')
    assert any("checksum mismatch" in p for p in problems(raw))


def test_non_increasing_reload_is_refused_and_counted(tmp_path: Path):
    path = tmp_path / "b.json"
    path.write_bytes(encode_bundle(NORTHSTAR))
    seen = []
    holder = PolicyHolder.load(str(path), on_reload=seen.append)
    for version in (41, 42):  # 42: another bundle of the version in force (the same one is "unchanged")
        path.write_bytes(encode_bundle(seal(msgspec.structs.replace(NORTHSTAR, bundle_version=version,
                                                                    published_at="2030-01-01T00:00:00Z"))))
        assert holder.reload().outcome == "stale"
    path.write_bytes(encode_bundle(NORTHSTAR))
    assert holder.reload().outcome == "unchanged"  # not reported
    path.write_bytes(b"{ not json")
    assert holder.reload().outcome == "invalid"
    assert holder.bundle is NORTHSTAR or holder.bundle == NORTHSTAR
    newer = seal(msgspec.structs.replace(NORTHSTAR, bundle_version=43))
    path.write_bytes(encode_bundle(newer))
    assert holder.poll() is not None or holder.bundle.bundle_version == 43
    assert holder.bundle.bundle_version == 43
    assert [r.outcome for r in seen][:3] == ["stale", "stale", "invalid"]
    assert holder.poll() is None  # unchanged file: nothing to do


def test_local_bounded_fallback_shapes():
    fb_bucket = Fallback(capacity_millis=5_000, refill_millis=250, period_ms=1_000)
    decode_bundle(sealed([tb("a", fail_mode="local_bounded", fallback=fb_bucket)]))
    assert problems(sealed([tb("a", fail_mode="local_bounded", fallback=Fallback(limit=5))]))


def test_invalid_bundle_at_start_raises_with_every_problem(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_bytes(sealed([tb("a", cost_millis=30_000), tb("b", fail_mode=None, route_group="x")]))
    with pytest.raises(PolicyError) as e:
        PolicyHolder.load(str(path))
    assert len(e.value.errors) >= 2


def test_a_pool_is_spent_from_one_balance_per_region():
    """Two pool rules a request selects together on the same pool (the same key
    twice in one script) do not validate; neither does a pool spent by rules of several tenants, of
    any tenant, or of both kinds (one fallback allowance per pool and region in the bound)."""
    pool = Pool(id="p", window_ms=60_000, limit=100, fallback_per_region=10)

    def pr(id: str, **kw) -> Rule:
        return make_rule(id=id, algorithm="pool", pool="p", fail_mode="local_bounded", **kw)

    dup = problems(sealed([pr("a", scope="tenant", tenant="atlas"),
                           pr("b", scope="tenant", tenant="atlas", route_group="read")], pools=[pool]))
    assert any("spends pool 'p' through more than one rule" in p for p in dup), dup
    for rules in ([pr("a", scope="tenant", tenant="atlas"), pr("b", scope="tenant", tenant="birch")],
                  [pr("a", scope="tenant")],
                  [pr("a", scope="global", route_group="read"), pr("b", scope="tenant", tenant="atlas")]):
        got = problems(sealed(rules, pools=[pool]))
        assert any("spent from more than one balance" in p for p in got), got
    # fine: one tenant's rules on different routes, or global rules on different routes
    decode_bundle(sealed([pr("a", scope="tenant", tenant="atlas", route_group="read"),
                          pr("b", scope="tenant", tenant="atlas", route_group="export")], pools=[pool]))
    decode_bundle(sealed([pr("a", scope="global", route_group="read"),
                          pr("b", scope="global", route_group="export")], pools=[pool]))


def test_every_request_is_for_ip_rules_and_written_only_when_set():
    """``everyRequest`` (the pre-authentication stage of every request) is an ip rule's flag; a
    bundle writes it (and its checksum covers it) only when true, so bundles sealed or signed
    before it existed keep their bytes and checksums."""
    ip = make_rule(id="edge", scope="ip", algorithm="fixed_window", limit=100, window_ms=10_000, fail_mode="open")
    flagged = msgspec.structs.replace(ip, every_request=True)
    assert b"everyRequest" not in sealed([ip])
    raw = sealed([flagged])
    assert b'"everyRequest": true' in raw and decode_bundle(raw).rules[0].every_request
    assert seal(Bundle(bundle_version=1, published_at="x", checksum="", rules=[ip])).checksum != \
        seal(Bundle(bundle_version=1, published_at="x", checksum="", rules=[flagged])).checksum
    assert any("everyRequest is for ip-scoped rules" in p
               for p in problems(sealed([tb("u", every_request=True)])))


def test_a_policy_source_where_a_bundle_belongs_is_named_as_such(tmp_path: Path):
    """The agent's and allocator's --policy, `leasehold up --policy`, `policy publish` and `sign`
    were given policies/northstar.yaml (the file docs/policy.md says you edit) and answered
    "bundle is not valid JSON: JSON is malformed: invalid character (byte 0)"."""
    source = Path(__file__).resolve().parents[3] / "policies" / "northstar.yaml"
    for path in (source, tmp_path / "missing.yml"):
        with pytest.raises(PolicyError) as e:
            load_bundle_file(str(path))
        assert e.value.detail == (f"{str(path)!r} is a policy source (YAML), not a sealed bundle (JSON): compile it "
                                  f"first with `leasehold policy compile {path}`")
    with pytest.raises(PolicyError, match="is a policy source"):
        PolicyHolder.load(str(source))


def _request_set_problems_for_every_rule(rules: list[Rule]) -> list[str]:
    """The check as it was written before it looked at the four buckets a request selects from: every
    rule for every (tenant, route group) pair (the reference the bucketed check must agree with)."""
    from kernel.bundle import MAX_RULES_PER_REQUEST, script_slots, select_rules

    tenants = sorted({r.tenant for r in rules if r.tenant}) + [None]
    routes = sorted({r.route_group for r in rules if r.route_group}) + ["\x00other"]
    out = []
    for tenant in tenants:
        for route in routes:
            for ptype, has_key in (("user", True), ("user", False), ("service", True), ("anonymous", False)):
                sel = select_rules(rules, tenant=tenant or "\x00any", route_group=route, principal_type=ptype,
                                   has_key=has_key)
                pools = [r.pool_id for r in sel if r.pool_id is not None and not r.shadow]
                out += [(ptype, tenant, route, p, tuple(r.id for r in sel if r.pool_id == p))
                        for p in sorted({p for p in pools if pools.count(p) > 1})]
                if script_slots(sel) > MAX_RULES_PER_REQUEST:
                    out.append((ptype, tenant, route, script_slots(sel), len(sel)))
    return [str(x) for x in out]


def test_the_request_set_check_agrees_with_checking_every_rule_for_every_pair():
    """Random rule sets (tenant-wide and route-specific, exempt, concurrency gates, shadows, pools): the
    bucketed check finds a problem exactly when the one over every rule did, with the same rule sets."""
    import random

    from kernel.bundle import _request_set_problems

    rng = random.Random(7)
    scopes = ("ip", "user", "key", "route", "tenant")
    for _ in range(300):
        rules = []
        seen = set()
        for i in range(rng.randint(4, 30)):
            scope = rng.choice(scopes)
            tenant = None if scope == "ip" or rng.random() < 0.4 else rng.choice(("atlas", "birch"))
            route = rng.choice((None, "read", "write"))
            if (scope, route, tenant) in seen:
                continue
            seen.add((scope, route, tenant))
            exempt = tenant is not None and rng.random() < 0.1
            rules.append(tb(f"r{i}", scope=scope, tenant=tenant, route_group=route, exempt=exempt,
                            owner="sre" if exempt else None, fail_mode="closed",
                            shadow=not exempt and rng.random() < 0.1,
                            concurrency_max=3 if scope != "ip" and rng.random() < 0.5 else None))
        got = _request_set_problems(rules)
        want = _request_set_problems_for_every_rule(rules)
        assert bool(got) == bool(want), (rules, got, want)
        assert len(got) == len(set(want)), (got, want)  # one problem per request set, both ways


def test_a_bundle_naming_thousands_of_tenants_and_route_groups_is_refused_at_once():
    """400 tenant rules on no route group and 400 route rules for every tenant: 160,801 request sets. The
    check took every rule for every pair (cubic: minutes here, hours for a bundle etcd still takes) on every
    agent reading it from etcd, before its signature was looked at; it is now refused, naming the sizes."""
    from kernel.bundle import MAX_REQUEST_SETS

    rules = [tb(f"t{i}", scope="tenant", tenant=f"t{i}", route_group=None, fail_mode="closed") for i in range(400)]
    rules += [tb(f"g{i}", scope="route", route_group=f"g{i}", fail_mode="closed") for i in range(400)]
    found = problems(sealed(rules))
    assert found == [f"the rules name 400 tenants and 400 route groups: 160,801 combinations of a request's rule "
                     f"set to check, more than {MAX_REQUEST_SETS:,}: rules name fewer tenants or route groups"]
    decode_bundle(sealed(rules[:300] + rules[400:600]))  # 301 x 201 sets: checked, valid
