"""Pre-authentication limiting on the real Redis fixture: failed authentications reported by
the gateway count against the caller's IP budget, never the claimed tenant's; a source cannot
mint unbounded per-IP keys (new keys per coarse source are capped per window)."""

from __future__ import annotations

import redis
from litestar.testing import AsyncTestClient

from region_agent.decision.preauth import NewKeyCap
from region_agent.service.app import create_app
from tests.support.agent import PEPPER, admit_body, make_settings
from tests.support.policies import northstar


def failed_login(i: int, ip: str = "203.0.113.7") -> dict:
    body = admit_body(f"failed-{i:06d}", tenant="atlas", route="login")
    return {**body, "authFailed": True, "clientIp": ip}


async def test_failed_auth_counts_against_the_ip_never_the_tenant(redis_url, policy_file):
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(make_settings(redis_url, policy_file), pepper=PEPPER)) as agent:
        ds = [(await agent.post("/v1/admit", json=failed_login(i))).json() for i in range(22)]
        # anon-login: 20 per 10 s per IP — the 21st failed login from that IP is refused
        assert [d["allowed"] for d in ds] == [True] * 20 + [False] * 2
        assert ds[-1]["deniedScope"] == "ip" and ds[-1]["httpStatus"] == 429
        assert ds[-1]["problem"] == {"type": "about:blank", "title": "Too Many Requests", "status": 429}
        keys = [k.decode() for k in r.keys("*")]
        assert keys and all("{ip:" in k for k in keys)
        assert not any("atlas" in k or "{t:" in k for k in keys)  # Atlas's keys never touched
        # another IP still has its own budget; Atlas's own traffic is unaffected
        assert (await agent.post("/v1/admit", json=failed_login(99, ip="198.51.100.1"))).json()["allowed"]
        ok = (await agent.post("/v1/admit", json=admit_body("atlas-000001", tenant="atlas"))).json()
        assert ok["allowed"] and ok["remaining"] == 19
        # authFailed without clientIp, or with a non-address: 422 problem, nothing written
        before = r.dbsize()
        for bad in ({**failed_login(1000), "clientIp": None}, {**failed_login(1001), "clientIp": "atlas}{:x"}):
            resp = await agent.post("/v1/admit", json=bad)
            assert resp.status_code == 422 and resp.headers["content-type"].startswith("application/problem+json")
        assert r.dbsize() == before


async def test_new_keys_per_source_are_capped(redis_url, policy_file):
    settings = make_settings(redis_url, policy_file, anon_new_keys_per_source=3)
    r = redis.Redis.from_url(redis_url)
    async with AsyncTestClient(app=create_app(settings, pepper=PEPPER)) as agent:
        def anon(i: int, ip: str) -> dict:
            return admit_body(f"anon-{i:06d}", tenant=None, ptype="anonymous", pid=ip, route="login", api_key=None)
        ds = [(await agent.post("/v1/admit", json=anon(i, f"10.1.0.{i}"))).json() for i in range(1, 6)]
        assert [d["allowed"] for d in ds] == [True, True, True, False, False]
        assert ds[3]["deniedScope"] == "ip" and ds[3]["httpStatus"] == 429 and "Retry-After" in ds[3]["headers"]
        ip_keys = {k for k in r.keys("rl:*") if b":ip:" in k}
        # the refused addresses never created keys: 3 addresses x (login window + every-route window)
        assert len(ip_keys) == 3 * 2 and len({k.split(b":")[3] for k in ip_keys}) == 3
        # keys already seen keep working; another /16 has its own allowance
        assert (await agent.post("/v1/admit", json=anon(6, "10.1.0.2"))).json()["allowed"]
        assert (await agent.post("/v1/admit", json=anon(7, "10.2.0.1"))).json()["allowed"]
        # the decision metrics add up: the two refusals counted as the pre-authentication stage's
        # denials (tenant none, the ip rule whose cap refused), the five others as the script's
        exposition = (await agent.get("/metrics")).text
        assert decisions(exposition) == 7
        assert decisions(exposition, source="preauth") == 2
        assert decisions(exposition, source="preauth", outcome="denied", tenant="none", route_group="login",
                         rule="anon-login") == 2
        assert decisions(exposition, source="script", outcome="allowed") == 5


def decisions(exposition: str, **labels: str) -> float:
    """The sum of leasehold_agent_decisions_total over the series with these labels."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith("leasehold_agent_decisions_total{"):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def test_new_key_cap_is_bounded_and_resets_per_window():
    now = [0.0]
    rule = northstar().rules[3]
    assert rule.scope == "ip"
    cap = NewKeyCap(per_source=2, window_ms=1_000, max_sources=2, clock=lambda: now[0])
    import ipaddress
    a = ipaddress.ip_address
    assert cap.admit(a("10.0.0.1"), rule) and cap.admit(a("10.0.0.2"), rule)
    assert not cap.admit(a("10.0.0.3"), rule)
    assert cap.admit(a("10.9.0.1"), rule)  # second source
    assert not cap.admit(a("10.8.0.1"), rule)  # max_sources reached
    now[0] = 1.5  # next window
    assert cap.admit(a("10.0.0.3"), rule) and cap.admit(a("10.8.0.1"), rule)
    assert cap.refused == 2
