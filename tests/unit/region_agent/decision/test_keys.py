from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kernel.bundle import Bundle, make_rule
from kernel.errors import ValidationFailed
from kernel.ids import is_id_text
from region_agent.decision.keys import KeyBuilder, hash_tag, ip_prefix, parse_ip
from region_agent.decision.plan import Snapshot, build_plan, check_tenant
from region_agent.models import AdmitRequest, Principal

PEPPER = b"unit-pepper"
KB = KeyBuilder(PEPPER)
USER_READ = make_rule(id="r", scope="user", route_group="read", algorithm="token_bucket", capacity_millis=20_000,
                 refill_millis=2_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded")
TENANT_ALL = make_rule(id="t", scope="tenant", algorithm="token_bucket", capacity_millis=1_000_000,
                  refill_millis=1_000_000, period_ms=60_000, cost_millis=1_000, fail_mode="local_bounded")
ANON = make_rule(id="a", scope="ip", route_group="login", algorithm="fixed_window", limit=20, window_ms=10_000,
            fail_mode="open")
KEY_RE = re.compile(r"^rl:v3:\{t:[a-z0-9-]{1,32}\}:(u|k|route|tenant|d|pool)(:[A-Za-z0-9_.-]+)+$")


def expected_h(tenant: str, kind: str, ident: str) -> str:
    return hmac.new(PEPPER, f"{tenant}\x1f{kind}\x1f{ident}".encode(), hashlib.sha256).hexdigest()[:16]


def test_user_key_shape_and_hmac_truncation():
    key = KB.rule_key(USER_READ, tenant="atlas", user_id="U-17", api_key_id="K1", route_group="read")
    assert key == f"rl:v3:{{t:atlas}}:u:{expected_h('atlas', 'u', 'U-17')}:read"
    assert len(expected_h("atlas", "u", "U-17")) == 16
    assert "U-17" not in key


def test_every_scope_shares_the_tenant_tag():
    key_rule = make_rule(id="k", scope="key", algorithm="fixed_window", limit=5, window_ms=1000, fail_mode="open")
    route_rule = make_rule(id="rt", scope="route", route_group="export", algorithm="fixed_window", limit=5,
                      window_ms=1000, fail_mode="open")
    keys = [
        KB.rule_key(USER_READ, tenant="atlas", user_id="U-17", api_key_id="K1", route_group="read"),
        KB.rule_key(key_rule, tenant="atlas", user_id="U-17", api_key_id="K1", route_group="read"),
        KB.rule_key(route_rule, tenant="atlas", user_id=None, api_key_id=None, route_group="export"),
        KB.rule_key(TENANT_ALL, tenant="atlas", user_id=None, api_key_id=None, route_group="read"),
        KB.decision_key("r-9f3a61c2e07b4d18", tenant="atlas"),
        KB.tenant_pool_key("atlas", "p-x"),
        KB.cc_key(KB.rule_key(TENANT_ALL, tenant="atlas", user_id=None, api_key_id=None, route_group="read")),
    ]
    assert keys[1] == f"rl:v3:{{t:atlas}}:k:{expected_h('atlas', 'k', 'K1')}:all"
    assert keys[2] == "rl:v3:{t:atlas}:route:atlas:export"
    assert keys[3] == "rl:v3:{t:atlas}:tenant:atlas:all"
    assert keys[4] == f"rl:v3:{{t:atlas}}:d:{expected_h('atlas', 'd', 'r-9f3a61c2e07b4d18')}"
    assert keys[5] == "rl:v3:{t:atlas}:pool:p-x"
    assert keys[6].endswith(":tenant:atlas:all:cc")
    assert {hash_tag(k) for k in keys} == {"t:atlas"}
    assert KB.global_pool_key("p-global") == "rl:v3:{g:p-global}:pool:p-global"


def test_same_user_in_two_tenants_gets_two_hashes():
    a = KB.rule_key(USER_READ, tenant="atlas", user_id="U-17", api_key_id=None, route_group="read")
    b = KB.rule_key(USER_READ, tenant="birch", user_id="U-17", api_key_id=None, route_group="read")
    assert a.split(":")[5] != b.split(":")[5]


def test_pepper_changes_every_principal_hash_and_is_never_shown():
    other = KeyBuilder(b"another-pepper")
    assert other.h("atlas", "u", "U-17") != KB.h("atlas", "u", "U-17")
    assert "unit-pepper" not in repr(KB)
    with pytest.raises(ValueError):
        KeyBuilder(b"")


@pytest.mark.parametrize("pepper", [b"k", b"unit-pepper", bytes(range(63)), b"\xa5" * 64, bytes(range(65)),
                                    b"p" * 200])
@pytest.mark.parametrize("tenant, kind, ident", [
    ("atlas", "u", "U-17"), ("", "d", "req-1"), ("atlas", "q", "user\x1fUser-\u00e9\u4e2d\U0001f600\x1f\x1fread\x1f1"),
    ("birch", "k", "x" * 300), ("", "ip", "2001:db8::/64"), ("atlas", "u", "lone-\ud800-surrogate")])
def test_every_hash_is_the_one_shot_hmac_of_the_pepper(pepper: bytes, tenant: str, kind: str, ident: str):
    """The keys stored in Redis do not change: the hash made from the pads' precomputed states is
    ``hmac.digest``'s, for peppers shorter than SHA-256's 64-byte block, as long, and longer (hashed
    first), and for non-ASCII messages (a lone surrogate passes as its UTF-8 bytes)."""
    msg = (tenant + "\x1f" + kind + "\x1f" + ident).encode("utf-8", "surrogatepass")
    want = hmac.digest(pepper, msg, "sha256")[:8].hex()
    kb = KeyBuilder(pepper)
    assert kb.h(tenant, kind, ident) == want
    assert kb.h(tenant, kind, ident) == want  # (remembered, and the pads' states are not spent by a use)
    assert kb.question(tenant=tenant, principal_type="user", principal_id="U", api_key_id=None, route_group="r",
                       cost_hint=1) == hmac.digest(pepper, (tenant + "\x1fq\x1fuser\x1fU\x1f\x1fr\x1f1").encode(),
                                                   "sha256")[:8].hex()


@pytest.mark.parametrize("raw, v4, v6, expect", [
    ("203.0.113.9", 32, 64, "203.0.113.9/32"),
    ("203.0.113.9", 24, 64, "203.0.113.0/24"),
    ("2001:db8:1:2:3:4:5:6", 32, 64, "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff::1", 32, 48, "2001:db8:1::/48"),
    ("::ffff:198.51.100.7", 32, 64, "198.51.100.7/32"),
])
def test_ip_prefixes(raw, v4, v6, expect):
    assert ip_prefix(parse_ip(raw), v4, v6) == expect


def test_ipv6_hosts_in_one_64_share_a_key_and_ipv4_hosts_do_not():
    def key(ip: str) -> str:
        addr = parse_ip(ip)
        return KB.rule_key(ANON, tenant=None, user_id=None, api_key_id=None, route_group="login",
                           ip_tag=KB.ip_tag(addr, [ANON]), addr=addr)

    assert key("2001:db8::1") == key("2001:db8::ffff:1")
    assert key("2001:db8::1") != key("2001:db8:0:1::1")
    assert key("203.0.113.9") != key("203.0.113.10")
    k = key("203.0.113.9")
    assert k.startswith("rl:v3:{ip:") and k.endswith(":login") and "203.0.113" not in k
    assert hash_tag(k).startswith("ip:")


def test_anonymous_tag_is_the_widest_prefix_so_two_ip_rules_share_a_slot():
    wide = make_rule(id="w", scope="ip", algorithm="fixed_window", limit=200, window_ms=10_000, fail_mode="open",
                ipv4_prefix=24)
    addr = parse_ip("203.0.113.9")
    tag = KB.ip_tag(addr, [ANON, wide])
    k1 = KB.rule_key(ANON, tenant=None, user_id=None, api_key_id=None, route_group="login", ip_tag=tag, addr=addr)
    k2 = KB.rule_key(wide, tenant=None, user_id=None, api_key_id=None, route_group="login", ip_tag=tag, addr=addr)
    assert hash_tag(k1) == hash_tag(k2) and k1 != k2
    neighbour = parse_ip("203.0.113.77")
    assert KB.ip_tag(neighbour, [ANON, wide]) == tag


@pytest.mark.parametrize("tenant", ["at}las", "at{las", "at:las", "ATLAS", "", "a" * 33, "ätlas", "at las",
                                    "atlas\n", "t:atlas}:{x", None, 17])
def test_hostile_tenant_ids_never_produce_a_key(tenant):
    """A tenant id is checked once, where the request enters (region_agent.decision.plan module doc): the
    wire decoder refuses it, and so does planning a request built in process."""
    with pytest.raises(ValidationFailed):
        check_tenant(tenant)
    body = {"requestId": "r-9f3a61c2e07b4d18", "principal": {"type": "user", "id": "U-17"}, "routeGroup": "read",
            "tenantId": tenant}
    if tenant is None:  # decodes (anonymous callers have none), but a user's request is refused
        with pytest.raises(ValidationFailed):
            build_plan(SNAP, msgspec.json.decode(msgspec.json.encode(body), type=AdmitRequest), KB, checked=True)
        return
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(body), type=AdmitRequest, strict=True)
    if isinstance(tenant, str):
        with pytest.raises(ValidationFailed):
            build_plan(SNAP, AdmitRequest(request_id="r-9f3a61c2e07b4d18", principal=Principal(type="user", id="U-17"),
                                          route_group="read", tenant_id=tenant), KB)


def test_a_tenant_rule_without_a_tenant_has_no_key():
    with pytest.raises(ValidationFailed):
        KB.rule_key(USER_READ, tenant=None, user_id="U-17", api_key_id=None, route_group="read")
    with pytest.raises(ValidationFailed):
        KB.decision_key("r-9f3a61c2e07b4d18", tenant=None)


SNAP = Snapshot(Bundle(bundle_version=1, published_at="2026-01-01T00:00:00Z", checksum="-", rules=[USER_READ]))


@settings(max_examples=200, deadline=None)
@given(tenant=st.text(max_size=40), user=st.text(min_size=1, max_size=256).filter(is_id_text))  # a Principal's
def test_any_key_that_is_produced_is_well_formed(tenant, user):
    req = AdmitRequest(request_id="r-9f3a61c2e07b4d18", principal=Principal(type="user", id=user),
                       route_group="read", tenant_id=tenant)
    try:
        plan = build_plan(SNAP, req, KB)  # a request built in process: checked once, here
    except ValidationFailed:
        assert not re.fullmatch(r"[a-z0-9-]{1,32}", tenant)
        return
    (call,) = plan.calls
    assert KEY_RE.match(call.key), call.key
    assert hash_tag(call.key) == f"t:{tenant}"


def test_bad_addresses_are_rejected():
    for raw in ("not-an-ip", "999.1.1.1", "", "1.2.3.4/24"):
        with pytest.raises(ValidationFailed):
            parse_ip(raw)
    assert isinstance(parse_ip("10.0.0.1"), ipaddress.IPv4Address)


@settings(max_examples=400, deadline=None)
@given(v4=st.ip_addresses(v=4), v6=st.ip_addresses(v=6), b4=st.integers(0, 32), b6=st.integers(0, 128))
def test_ip_prefix_is_the_networks_text(v4, v6, b4, b6):
    """ip_prefix masks integers; it must give what ipaddress.ip_network prints for the same prefix."""
    assert ip_prefix(v4, b4, b6) == str(ipaddress.ip_network(f"{v4}/{b4}", strict=False))
    assert ip_prefix(v6, b4, b6) == str(ipaddress.ip_network(f"{v6}/{b6}", strict=False))


_ID = st.text(st.sampled_from("ab\x1f"), min_size=1, max_size=4)


@given(_ID, st.none() | _ID, _ID, st.none() | _ID)
@example("P\x1fK", None, "P", "K\x1f")  # the boundary between the ids moved
@example("P\x1f", "K", "P", "\x1fK")
def test_a_question_names_one_principal_and_key_whatever_their_ids_hold(pid1, key1, pid2, key2):
    """The ids may hold the question's separator (0x1F): two questions are the same only for the
    same principal id and API key id (a record answers only its own question)."""
    def q(pid: str, key: str | None) -> str:
        return KB.question(tenant="atlas", principal_type="user", principal_id=pid, api_key_id=key,
                           route_group="export", cost_hint=1)

    assert (q(pid1, key1) == q(pid2, key2)) == ((pid1, key1) == (pid2, key2))


def test_a_question_without_the_separator_keeps_its_hash():
    """Records written before stay replayable: the question of ids without 0x1F is hashed as it was."""
    ident = "\x1f".join(("user", "U-17", "K1", "read", "1"))
    digest = hmac.new(PEPPER, ("atlas\x1fq\x1f" + ident).encode(), hashlib.sha256).hexdigest()[:16]
    assert KB.question(tenant="atlas", principal_type="user", principal_id="U-17", api_key_id="K1",
                       route_group="read", cost_hint=1) == digest
