"""The pre-authentication stage on every request, through real gateways: the end-to-end trace's
step 1 (the edge runs P-ANON's fixed window for the caller's address before authentication:
count 7 of 20, passes) and credential guessing on an authenticated route (every failed
authentication spends the address's window, never the claimed tenant, until the address is
refused with the generic 429).

The agent runs the Northstar bundle with P-ANON marked ``everyRequest`` on every route (the
trace's reading of stage 1) in place of the login-only rule; Envoy (rate limit service) and
nginx (forward auth, the agent verifying tokens) run their shipped configurations."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from redis import Redis

from kernel.bundle import encode_bundle, load_bundle_file, seal
from leasehold.local.devjwt import DevIssuer
from leasehold.local.gateways import Envoy, Nginx
from tests.support.redis_buckets import user_key
from tests.support.windows import clear_of_window_edges_sync

from .attacks import keys, tokens
from .conftest import KEYS, NORTHSTAR, Stack, identity

pytestmark = pytest.mark.e2e

WINDOW_MS = 10_000


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    b = load_bundle_file(str(NORTHSTAR))
    rules = []
    for r in b.rules:
        if r.id == "edge-ip":
            continue
        if r.id == "anon-login":  # P-ANON: 20 per 10 s per address, on every request and route
            r = msgspec.structs.replace(r, every_request=True, route_group=None)
        rules.append(r)
    path = Path(tmp_path_factory.mktemp("stage1")) / "trace.json"
    path.write_bytes(encode_bundle(seal(msgspec.structs.replace(b, rules=rules))))
    return path


@pytest.fixture(scope="module")
def bearer_at_the_agent() -> bool:
    return True  # for nginx; the rate limit service takes Envoy's verified headers either way


@pytest.fixture(scope="module")
def rls_envoy(stack: Stack) -> Iterator[Envoy]:
    e = stack.envoy("envoy-rls", "envoy-rls.yaml")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def nginx(stack: Stack) -> Iterator[Nginx]:
    n = stack.nginx()
    yield n
    n.stop()


def window_key(addr: str) -> str:
    h = KEYS.h("", "ip", f"{addr}/32")
    return f"rl:v3:{{ip:{h}}}:ip:{h}:all"


def set_window(stack: Stack, addr: str, n: int) -> None:
    """The address's P-ANON window at count ``n`` in the current window (Redis's clock)."""
    r = Redis(port=stack.redis.port)
    sec, usec = r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    key = window_key(addr)
    r.hset(key, mapping={"w": now - now % WINDOW_MS, "n": n})
    r.pexpire(key, 20_000)
    r.close()


def count(stack: Stack, addr: str) -> int:
    r = Redis(port=stack.redis.port)
    try:
        return int(r.hget(window_key(addr), "n") or 0)
    finally:
        r.close()


def client(url: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10, transport=httpx.HTTPTransport(local_address=source))


def test_trace_step_1_the_address_window_before_authentication(stack: Stack, rls_envoy: Envoy):
    """Step 1: the address's window at 6 of 20; K1's GET /catalog (Atlas, U-17) counts 7 of 20 and
    passes; then steps 5-6 as before: U-17's bucket 20,000 -> 19,000, Atlas 640,000 -> 639,000."""
    source = "127.0.5.1"
    atlas = "rl:v3:{t:atlas}:tenant:atlas:all"
    r = Redis(port=stack.redis.port)
    r.hset(atlas, mapping={"tokens": 640_000, "ts": int(r.time()[0]) * 1000 + 3_600_000})
    r.pexpire(atlas, 600_000)
    r.close()
    for attempt in range(3):  # the window must not roll between the set-up and the request
        clear_of_window_edges_sync(10_000, before_ms=5_000)
        set_window(stack, source, 6)
        with client(rls_envoy.url, source) as c:
            resp = c.get("/catalog", headers=identity("U-17", "atlas", "K1"))
        if count(stack, source) == 7 or attempt == 2:
            break
    assert resp.status_code == 200 and resp.json()["upstream"] == "upstream"
    assert count(stack, source) == 7  # count 7 of 20 in the current 10 s window; passes
    assert tokens(stack, user_key("atlas", "U-17", "read", keys=KEYS)) == 19_000
    assert tokens(stack, atlas) == 639_000


@pytest.mark.parametrize("gateway", ["envoy", "nginx"])
def test_credential_guessing_on_an_authenticated_route_spends_the_address_window(
        stack: Stack, rls_envoy: Envoy, nginx: Nginx, gateway: str):
    """Failed authentications on /catalog (tokens of a stranger's key claiming Birch, garbage,
    none) are counted against the caller's address: at 18 of 20, two more are 401, the next is
    the generic 429 (Retry-After only) — and Birch has no state at all. A valid token from that
    address is refused too while the window lasts (stage 1 comes before authentication)."""
    source = "127.0.5.2" if gateway == "envoy" else "127.0.5.3"
    url = rls_envoy.url if gateway == "envoy" else nginx.url
    stranger = DevIssuer()
    guesses = [stranger.bearer("B-1", "birch"), {"authorization": "Bearer guess"}, {}]
    for attempt in range(3):
        clear_of_window_edges_sync(10_000, before_ms=5_000)
        set_window(stack, source, 18)
        with client(url, source) as c:
            answers = [c.get("/catalog", headers=h) for h in guesses]
            valid = c.get("/catalog", headers=identity("U-90", "atlas"))
        if count(stack, source) == 20 or attempt == 2:
            break
    assert [a.status_code for a in answers] == [401, 401, 429], [(a.status_code, a.text) for a in answers]
    denied = answers[2]
    assert 1 <= int(denied.headers["retry-after"]) <= 11
    assert "ratelimit" not in denied.headers and "ratelimit-policy" not in denied.headers
    assert denied.json() == {"type": "about:blank", "title": "Too Many Requests", "status": 429}
    assert valid.status_code == 429 and "ratelimit" not in valid.headers
    assert count(stack, source) == 20
    assert keys(stack, "rl:v3:{t:birch}*") == []
    assert tokens(stack, user_key("atlas", "U-90", "read", keys=KEYS)) is None  # refused before its tenant's rules: nothing spent
