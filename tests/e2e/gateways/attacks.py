"""What a hostile client sends through a shipped gateway configuration, and what must come of it:
nothing. Every scenario runs against a real gateway (Envoy, nginx, Traefik) configured from
``deploy/gateways/`` and checks what the client gets (status, Retry-After, RateLimit fields) and
which limit was spent in Redis.

The hostile headers: another tenant's and user's identity, a route group, a failed-authentication
flag, a cost, forwarding headers naming another address, a chosen request id, the agent's own
deny-status and token headers."""

from __future__ import annotations

import time

import httpx
from redis import Redis

from leasehold.local.devjwt import DevIssuer

from .conftest import KEYS, Stack, assert_p_read, identity, wait_early_in_window

FORGED_IP = "203.0.113.77"


def hostile(route_group: str = "export", request_id: str = "client-chosen-id-0001") -> dict[str, str]:
    """Every header a client could hope would steer the limiter."""
    return {"x-tenant-id": "birch", "x-user-id": "B-1", "x-api-key-id": "KX", "x-service-id": "svc",
            "x-route-group": route_group, "x-leasehold-auth-failed": "true", "x-leasehold-cost": "0",
            "x-forwarded-for": FORGED_IP, "x-real-ip": FORGED_IP, "x-request-id": request_id,
            "x-forwarded-uri": "/login", "x-leasehold-deny-status": "401",
            "x-leasehold-authorization": "Bearer not-the-gateway"}


def keys(stack: Stack, pattern: str) -> list[str]:
    r = Redis(port=stack.redis.port)
    try:
        return sorted(k.decode() for k in r.scan_iter(match=pattern, count=1000))
    finally:
        r.close()


def ip_keys_of(stack: Stack, addr: str) -> list[str]:
    """Every per-address key of ``addr`` (ip rules hash the /32 in the tag and in the key)."""
    h = KEYS.h("", "ip", f"{addr}/32")
    return [k for k in keys(stack, "rl:v3:{ip:*") if h in k]


def tokens(stack: Stack, key: str) -> int | None:
    r = Redis(port=stack.redis.port)
    try:
        v = r.hget(key, "tokens")
        return None if v is None else int(v)
    finally:
        r.close()


def user_key(user: str, tenant: str = "atlas", route: str = "read") -> str:
    return f"rl:v3:{{t:{tenant}}}:u:{KEYS.h(tenant, 'u', user)}:{route}"


def p_read_with_hostile_headers(stack: Stack, url: str, user: str, *, ratelimit_on_200: bool = True) -> None:
    """The worked P-READ numbers at the client while every request carries every hostile header:
    20 pass, the 21st is 429 with the caller's own RateLimit fields — the verified identity's
    bucket on the route's own group was spent, nothing of the claimed tenant, route, cost or
    address."""
    stack.full_frozen_bucket(user)
    with httpx.Client(base_url=url, timeout=10) as c:
        responses = [c.get("/catalog", headers={**hostile(), **identity(user)}) for _ in range(21)]
    if ratelimit_on_200:
        assert_p_read(responses)
    else:  # Traefik: a 200 carries no RateLimit fields to the client
        assert [r.status_code for r in responses] == [200] * 20 + [429], [r.status_code for r in responses]
        assert responses[20].headers["ratelimit"] == '"read-user-v3";r=0;t=1'
    assert tokens(stack, user_key(user)) == 0  # the verified user's read bucket: 20 spent
    assert keys(stack, "rl:v3:{t:birch}*") == []  # the claimed tenant: nothing
    assert keys(stack, "rl:v3:{t:atlas}:tenant:atlas:export*") == []  # the claimed route group: nothing
    assert ip_keys_of(stack, FORGED_IP) == []  # the claimed address: nothing
    backend = responses[0].json()["headers"]
    assert backend.get("x-request-id") != "client-chosen-id-0001"


def no_token_claims_nothing(stack: Stack, url: str) -> None:
    """Without a valid token the identity headers name nobody: 401, and no state for the tenant
    they claim (a token signed by another key is no token)."""
    stranger = DevIssuer()  # right issuer and audience, wrong key
    with httpx.Client(base_url=url, timeout=10) as c:
        for extra in ({}, {"authorization": "Bearer not.a.jwt"}, stranger.bearer("B-9", "birch")):
            r = c.get("/catalog", headers={**hostile(), "x-leasehold-auth-failed": "false", **extra})
            assert r.status_code == 401, (extra, r.status_code, r.text)
    assert keys(stack, "rl:v3:{t:birch}*") == []


def route_group_is_the_routes(stack: Stack, url: str, tenant: str) -> None:
    """X-Route-Group: read on the export route still takes an export slot (the concurrency gate
    of export-tenant); X-Route-Group: login on /catalog still spends the read bucket."""
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/reports/export", headers={**hostile(route_group="read"), **identity("U-70", tenant)})
        assert r.status_code == 200, r.text
        r = c.get("/catalog", headers={**hostile(route_group="login"), **identity("U-70", tenant)})
        assert r.status_code == 200, r.text
    assert keys(stack, f"rl:v3:{{t:{tenant}}}:tenant:{tenant}:export*"), "the export route's rule was not spent"
    assert tokens(stack, user_key("U-70", tenant)) is not None, "the read bucket was not spent"


def replayed_request_id_is_not_the_clients(stack: Stack, url: str, tenant: str) -> None:
    """A request id the client chose, sent with two identities to an idempotent rule (export):
    both admitted, neither decided under the client's id (the gateway mints decision ids)."""
    chosen = "client-chosen-id-0002"
    with httpx.Client(base_url=url, timeout=10) as c:
        for user in ("U-71", "U-72"):
            r = c.post("/reports/export", headers={**hostile(request_id=chosen), **identity(user, tenant)})
            assert r.status_code == 200, (user, r.status_code, r.text)
    record = f"rl:v3:{{t:{tenant}}}:d:{KEYS._hmac(tenant, 'd', chosen)}"
    assert keys(stack, record) == []
    assert len(keys(stack, f"rl:v3:{{t:{tenant}}}:d:*")) == 2  # one record per request, under minted ids


def forged_forwarding_headers_count_the_connection(stack: Stack, url: str, source: str) -> None:
    """Pre-auth (P-ANON on /login, 20 per 10 s per address) from the connection address
    ``source`` (a loopback address of its own), with a different forged X-Forwarded-For /
    X-Real-IP on each request: all 21 count against ``source``: exactly 20 pass, the 21st is the
    generic 429; no state for a forged address."""
    transport = httpx.HTTPTransport(local_address=source)
    for attempt in range(3):
        r = Redis(port=stack.redis.port)
        for k in ip_keys_of(stack, source):
            r.delete(k)
        r.close()
        wait_early_in_window(10, 6.0)
        started = time.monotonic()
        with httpx.Client(base_url=url, timeout=10, transport=transport) as c:
            codes = [c.post("/login", content=b"u=x", headers={**hostile(), "x-forwarded-for": f"198.51.100.{i}",
                                                                "x-real-ip": f"198.51.100.{i}"}).status_code
                     for i in range(21)]
        if codes == [200] * 20 + [429] or attempt == 2:
            break
        if time.monotonic() - started < 5.5:
            break  # the window held: the answer stands as it is
        time.sleep(10)  # a stalled machine crossed the window's edge: run again in a fresh window
    assert codes == [200] * 20 + [429], codes
    assert all(ip_keys_of(stack, f"198.51.100.{i}") == [] for i in range(21))
    assert ip_keys_of(stack, source)


__all__ = ["FORGED_IP", "forged_forwarding_headers_count_the_connection", "hostile", "ip_keys_of", "keys",
           "no_token_claims_nothing", "p_read_with_hostile_headers", "replayed_request_id_is_not_the_clients",
           "route_group_is_the_routes", "tokens", "user_key"]
