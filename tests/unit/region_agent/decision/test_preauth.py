"""region_agent.decision.preauth: the per-source cap on new per-IP keys and failed-authentication requests."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import msgspec
import pytest

from kernel.bundle import load_bundle_file
from kernel.errors import ValidationFailed
from region_agent.decision.plan import Snapshot
from region_agent.decision.preauth import NewKeyCap, as_failed_auth
from region_agent.models import AdmitRequest, DeniedScope, Principal, Reason
from tests.support.clock import FakeClock

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))
ANON_LOGIN = next(r for r in NORTHSTAR.rules if r.id == "anon-login")  # ip scope, /32


def ip(text: str):
    return ipaddress.ip_address(text)


def anon(addr: str, route: str = "login", rid: str = "r-1") -> AdmitRequest:
    return AdmitRequest(request_id=rid, principal=Principal(type="anonymous", id=addr), route_group=route)


def test_new_keys_past_the_per_source_cap_are_refused_and_seen_keys_keep_working():
    cap = NewKeyCap(per_source=2, window_ms=60_000, clock=FakeClock(1_000.25))
    assert cap.admit(ip("203.0.113.1"), ANON_LOGIN) and cap.admit(ip("203.0.7.9"), ANON_LOGIN)  # same /16
    assert not cap.admit(ip("203.0.1.1"), ANON_LOGIN)  # a third new key of 203.0/16
    assert cap.admit(ip("203.0.113.1"), ANON_LOGIN)  # already seen this window
    assert cap.admit(ip("198.51.100.1"), ANON_LOGIN)  # another source has its own cap
    assert cap.refused == 1


def test_the_per_ip_key_uses_the_rules_prefix():
    wide = msgspec.structs.replace(ANON_LOGIN, ipv4_prefix=24)
    cap = NewKeyCap(per_source=1, window_ms=60_000, clock=FakeClock(1_000.25))
    assert cap.admit(ip("203.0.113.1"), wide)
    assert cap.admit(ip("203.0.113.200"), wide)  # the same /24 key
    assert not cap.admit(ip("203.0.114.1"), wide)


def test_ipv6_sources_are_coarse_slash_32s():
    cap = NewKeyCap(per_source=1, window_ms=60_000, clock=FakeClock(1_000.25))
    assert cap.admit(ip("2001:db8:1::1"), ANON_LOGIN)
    assert not cap.admit(ip("2001:db8:2::1"), ANON_LOGIN)  # another /64 in the same /32
    assert cap.admit(ip("2001:db9::1"), ANON_LOGIN)


def test_everything_is_forgotten_when_the_window_rolls():
    clock = FakeClock(120.0)  # window 2 of 60 s
    cap = NewKeyCap(per_source=1, window_ms=60_000, clock=clock)
    assert cap.admit(ip("203.0.113.1"), ANON_LOGIN)
    assert not cap.admit(ip("203.0.113.2"), ANON_LOGIN)
    clock.t = 180.0
    assert cap.admit(ip("203.0.113.2"), ANON_LOGIN)


def test_sources_are_bounded_too():
    cap = NewKeyCap(per_source=5, window_ms=60_000, max_sources=2, clock=FakeClock(1_000.25))
    assert cap.admit(ip("10.1.0.1"), ANON_LOGIN) and cap.admit(ip("10.2.0.1"), ANON_LOGIN)
    assert not cap.admit(ip("10.3.0.1"), ANON_LOGIN)  # a third source in this window
    assert cap.admit(ip("10.1.0.2"), ANON_LOGIN)  # known sources keep their budget


def test_check_denies_with_deniedscope_ip_until_the_window_ends():
    clock = FakeClock(1_000.25)  # 40.25 s into a 60 s window
    cap = NewKeyCap(per_source=1, window_ms=60_000, clock=clock)
    assert cap.check(Snapshot(NORTHSTAR), anon("203.0.113.1")) is None
    d = cap.check(Snapshot(NORTHSTAR), anon("203.0.113.2", rid="r-2"))
    assert d is not None and not d.allowed
    assert (d.decision_id, d.denied_scope, d.reason, d.rule_id) == ("r-2", DeniedScope.IP, Reason.RATE_EXCEEDED,
                                                                       None)
    assert d.retry_after_ms == 19_750 and d.http_status == 429 and d.headers["Retry-After"].isdigit()
    assert d.bundle_version == NORTHSTAR.bundle_version


def test_check_leaves_authenticated_requests_and_routes_without_ip_rules_alone():
    cap = NewKeyCap(per_source=0, window_ms=60_000, clock=FakeClock(1_000.25))
    user = AdmitRequest(request_id="r-1", tenant_id="atlas", principal=Principal(type="user", id="U-1"),
                        route_group="login")
    assert cap.check(Snapshot(NORTHSTAR), user) is None
    no_edge = msgspec.structs.replace(NORTHSTAR, rules=[r for r in NORTHSTAR.rules if r.id != "edge-ip"])
    assert cap.check(Snapshot(no_edge), anon("203.0.113.1", route="read")) is None  # no ip rule selected
    assert cap.check(Snapshot(NORTHSTAR), anon("203.0.113.1", route="read")) is not None  # the every-route window
    assert cap.check(Snapshot(NORTHSTAR), anon("203.0.113.1")) is not None  # per_source 0: every new key refused


def test_a_failed_authentication_is_an_anonymous_request_from_the_client_ip():
    req = AdmitRequest(request_id="r-7", tenant_id="atlas", principal=Principal(type="user", id="U-1",
                       api_key_id="K1"), route_group="login", cost_hint=2, bundle_version=42, auth_failed=True,
                       client_ip="203.0.113.9")
    out = as_failed_auth(req)
    assert out.principal == Principal(type="anonymous", id="203.0.113.9")
    assert out.tenant_id is None  # the claimed tenant is dropped: Atlas's keys are never spent
    assert (out.request_id, out.route_group, out.cost_hint, out.bundle_version) == ("r-7", "login", 2, 42)


@pytest.mark.parametrize("client_ip", [None, "not-an-ip"])
def test_a_failed_authentication_needs_a_valid_client_ip(client_ip):
    req = AdmitRequest(request_id="r-7", principal=Principal(type="user", id="U-1"), route_group="login",
                       auth_failed=True, client_ip=client_ip)
    with pytest.raises(ValidationFailed):
        as_failed_auth(req)
