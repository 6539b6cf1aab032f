"""What a hostile client sends through a shipped gateway configuration, and what must come of it:
nothing. Every scenario runs against a real gateway (Envoy, nginx, Traefik) configured from
``deploy/gateways/`` and checks what the client gets (status, Retry-After, RateLimit fields) and
which limit was spent in Redis.

The hostile headers: another tenant's and user's identity, a route group, a failed-authentication
flag, a cost, forwarding headers naming another address, a chosen request id, the agent's own
deny-status and token headers. The hostile paths (sent byte for byte on a socket of their own:
an HTTP library would normalise them first): look-alikes of the pre-authentication route, and
paths a gateway may read one way and a backend another. The hostile tokens: a second bearer
token in the query string; identity headers under a name a CGI-style backend reads as the real one
(``x_tenant_id``); a valid token whose claims no question can carry. The hostile connection: a protocol upgrade (WebSocket, h2c) that would carry
requests past the gateway once it is open."""

from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
from redis import Redis

from leasehold.local.devjwt import DevIssuer
from tests.support.redis_buckets import user_key
from tests.support.upgrade_backend import UpgradeBackend
from tests.support.windows import clear_of_window_edges_sync

from .conftest import ISSUER, KEYS, Stack, assert_p_read, identity

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
    assert tokens(stack, user_key("atlas", user, "read", keys=KEYS)) == 0  # the verified user's read bucket: 20 spent
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
    assert tokens(stack, user_key(tenant, "U-70", "read", keys=KEYS)) is not None, "the read bucket was not spent"


def decision_record(tenant: str, request_id: str) -> str:
    return f"rl:v3:{{t:{tenant}}}:d:{KEYS._hmac(tenant, 'd', request_id)}"


def replayed_request_id_is_not_the_clients(stack: Stack, url: str, tenant: str) -> None:
    """A request id the client chose, sent with two identities to an idempotent rule (export):
    both admitted, neither decided under the client's id (the gateway or the agent mints decision
    ids). The backend is handed the decision id each export was decided under (the one it ends
    the export's slot with), never the client's: Traefik used to hand it none."""
    chosen = "client-chosen-id-0002"
    handed: list[str] = []
    with httpx.Client(base_url=url, timeout=10) as c:
        for user in ("U-71", "U-72"):
            r = c.post("/reports/export", headers=[*hostile(request_id=chosen).items(), ("x-request-id", chosen),
                                                   *identity(user, tenant).items()])
            assert r.status_code == 200, (user, r.status_code, r.text)
            handed.append(r.json()["headers"].get("x-request-id", ""))
    assert keys(stack, decision_record(tenant, chosen)) == []
    assert len(keys(stack, f"rl:v3:{{t:{tenant}}}:d:*")) == 2  # one record per request, under minted ids
    assert all(rid and chosen not in rid for rid in handed), handed
    assert all(keys(stack, decision_record(tenant, rid)) for rid in handed), handed  # the decision ids


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
        clear_of_window_edges_sync(10_000, before_ms=6_000)
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


def _complete(data: bytes) -> bool:
    """The response in ``data`` is whole: its head and the ``content-length`` bytes it announces.
    Read to the end of the connection otherwise (no length: chunked, or until close). Envoy keeps
    a connection it closes after a local reply (a 400, an ``rbac`` 403) open for its
    ``delayed_close_timeout`` (1 s), so reading to the close cost a second a request there."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def send_raw(url: str, target: str, headers: dict[str, str] | list[tuple[str, str]] | None = None, *,
             method: str = "GET", source: str | None = None) -> tuple[int, dict | None]:
    """One HTTP/1.1 request with ``target`` on the request line exactly as given, from the
    loopback address ``source``: the status and, when the demo upstream answered, its JSON
    (``path`` is the request target the backend received), else None. ``headers``: a mapping, or
    name/value pairs (a name may repeat)."""
    u = urlsplit(url)
    assert u.hostname is not None and u.port is not None
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
    lines = [f"{method} {target} HTTP/1.1", f"host: {u.hostname}:{u.port}", "connection: close",
             *(f"{k}: {v}" for k, v in pairs)]
    if method in ("POST", "PUT"):
        lines.append("content-length: 0")
    with socket.create_connection((u.hostname, u.port), timeout=10,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        data = b""
        while not _complete(data) and (chunk := s.recv(65536)):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        doc = json.loads(body)
    except ValueError:
        return status, None
    return status, doc if isinstance(doc, dict) and "upstream" in doc else None


LOGIN_LOOKALIKES = ("/loginx", "/login.php", "/login-history", "/login;x", "/login%20")


def the_anonymous_route_is_login_alone(url: str, source: str) -> None:
    """The pre-authentication route (no token needed, only the address window spent) is /login
    and the paths under /login/, nothing else: a path that merely starts with the same letters
    is another resource of the backend, and without a token it is a 401 that never reaches it."""
    for path in LOGIN_LOOKALIKES:
        status, upstream = send_raw(url, path, source=source)
        assert status == 401 and upstream is None, (path, status, upstream)
    for path in ("/login", "/login/", "/login/step-2?next=x"):
        status, upstream = send_raw(url, path, method="POST", source=source)
        assert status == 200 and upstream is not None and upstream["path"] == path, (path, status, upstream)


# a gateway that routes on one reading of these and hands the backend another lets a client pick
# the route (and so the route group and whether a token is needed) apart from the resource served
AMBIGUOUS_PATHS = (
    "/catalog/../login", "/catalog/./../login", "/catalog%2F..%2Flogin", "/catalog/..%2Flogin",
    "/catalog/%2e%2e/login", "/login%2F..%2Fcatalog", "/login/x%2F..%2F..%2Fcatalog", "/login/..;/catalog",
    "/login/x/..%5C..%5Ccatalog", "/login/x\\..\\..\\catalog", "/reports/export/..%2F",
    "/catalog/..;/reports/export", "/catalog%2F..%2Freports%2Fexport",
    # a fragment on the request line: nginx routes on the path before "#" (the login location),
    # a backend that reads "#" as part of the path (Go's net/http) serves another resource
    "/login#/catalog", "/login#x",
    # an encoded NUL: a backend that cuts the path there or drops it reads "/login/.." or
    # "/login/../catalog"
    "/login/..%00/catalog",
)
_NOT_NORMAL = re.compile(r"%2[ef]|%5c|%00|#|\\|//|(^|/)\.\.?(;[^/]*)?(/|$)", re.I)


def ambiguous_paths_never_reach_the_backend(url: str, source: str, tenant: str) -> None:
    """A path with dot segments (also ``..;``), encoded slashes or dots, or backslashes reads
    differently to a gateway that normalises it and to a backend that does not (or that decodes
    more): the gateway either normalises it before it routes and forwards what it routed on, or
    refuses it. The backend only ever receives a path in normal form, and without a token only
    /login or a path under it."""
    for path in AMBIGUOUS_PATHS:
        for headers in ({}, identity("U-79", tenant)):
            status, upstream = send_raw(url, path, headers, source=source)
            if upstream is None:
                continue
            got = upstream["path"].split("?", 1)[0]
            assert not _NOT_NORMAL.search(got), (path, bool(headers), got)
            assert headers or got == "/login" or got.startswith("/login/"), (path, got)


# claims of a valid token that no question can carry (kernel.ids.TENANT_ID; a principal or key id
# of 1-256 characters): the identity provider issued them, so the client holds them legitimately
UNKEYABLE_CLAIMS = {
    "tenant not an id": ("U-74", "Unkeyable_Tenant", "K1"),
    "user id too long": ("U" * 300, "unkeyable", "K1"),
    "api key id too long": ("U-74", "unkeyable", "K" * 300),
}


def unkeyable_claims_are_refused(stack: Stack, url: str) -> None:
    """A valid token whose claims the agent cannot make a question of. The rate limit service
    answered INVALID_ARGUMENT, and the fail-open limiter (stage 0, reads) let the request through
    to the backend: every read of such a client passed, decided and charged nowhere. Refused at
    the gateway now (403: not a Leasehold identity), whatever the limiter answered, and never
    charged to anyone."""
    for name, (user, tenant, key) in UNKEYABLE_CLAIMS.items():
        status, upstream = send_raw(url, "/catalog", {"authorization": "Bearer " + ISSUER.token(user, tenant, key)})
        assert upstream is None and status in (403, 422), (name, status, upstream)
    assert keys(stack, "rl:v3:{t:unkeyable}*") == []


# claims of a valid token that are no header value as they are (region_agent/models.py's identity
# text): white space at either end, which the backend's parser trims into another principal
# (" admin" served as admin), and control characters, which no gateway forwards as they are
TEXTLESS_CLAIMS = {
    "space before the user": (" admin", None),
    "space after the user": ("admin ", None),
    "tab before the user": ("\tadmin", None),
    "tab inside the user": ("ad\tmin", None),
    "control character in the user": ("admin\x01", None),
    "DEL in the user": ("ad\x7fmin", None),
    "line break in the user": ("U-1\r\nx-tenant-id: birch", None),
    "space before the API key": ("U-75", " K1"),
    "control character in the API key": ("U-75", "K\x00"),
}


def claims_that_are_no_header_value_are_refused(stack: Stack, url: str, tenant: str, source: str,
                                                *, status: int) -> None:
    """A valid token whose user or API key claim is no header value as it is. Behind the Envoy
    files it was accepted: ``envoy-rls.yaml`` charged a bucket of " admin"'s own while the backend
    read ``admin`` (served as that principal), ``envoy-ext-authz.yaml`` charged ``admin`` itself.
    Every shipped file refuses it now -- ``status``: 403 at Envoy's ``rbac``, as a claim no question
    can carry; the agent's 422 behind nginx and Traefik -- on every route, before anything is
    spent: no key of the tenant, nothing of the caller's address, and the backend never reached."""
    answers = {}
    for name, (user, key) in TEXTLESS_CLAIMS.items():
        auth = {"authorization": "Bearer " + ISSUER.token(user, tenant, key)}
        for method, path in (("GET", "/catalog"), ("POST", "/reports/export")):
            got, upstream = send_raw(url, path, auth, method=method, source=source)
            answers[name, path] = got, upstream and upstream["headers"].get("x-user-id")
    assert answers == dict.fromkeys(answers, (status, None)), answers
    assert keys(stack, f"rl:v3:{{t:{tenant}}}*") == []
    assert ip_keys_of(stack, source) == []


UPGRADES = {
    "websocket": {"connection": "upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
                  "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="},
    "h2c": {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c", "http2-settings": "AAMAAABkAARAAAAAAAIAAAAA"},
}


def an_upgrade_opens_no_tunnel(url: str, backend: UpgradeBackend, tenant: str, kind: str) -> None:
    """A protocol upgrade (``kind``: a WebSocket, h2c) on the read route, to a backend that accepts
    every upgrade and then reads what follows as HTTP (:mod:`tests.support.upgrade_backend`). The
    gateway decides one request; through a tunnel, the client's exports that follow it reached the
    backend undecided and uncharged (Traefik forwarded the upgrade: 101, then every request
    inside it was served). No gateway opens a tunnel: the upgrade is refused, or the backend gets
    the request as a plain one (no Upgrade header), and nothing after it."""
    u = urlsplit(url)
    assert u.hostname is not None and u.port is not None
    backend.seen.clear()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"host": f"{u.hostname}:{u.port}", **identity("U-75", tenant),
                                                  **UPGRADES[kind]}.items())
    inner = b"POST /reports/export HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(f"GET /catalog HTTP/1.1\r\n{head}\r\n".encode("latin-1"))
        s.settimeout(3)
        first = b""
        while b"\r\n\r\n" not in first:
            chunk = s.recv(65536)
            if not chunk:
                break
            first += chunk
        status = int(first.split(b" ", 2)[1])
        if status == 101:  # the tunnel is open: what an attacker sends next, no gateway sees
            s.sendall(inner * 3)
            time.sleep(0.5)
    assert status != 101, (kind, first[:200])
    assert not [r for r in backend.seen if r["tunnelled"] or r["upgrade"] is not None], (kind, backend.seen)
    assert len(backend.seen) <= 1, (kind, backend.seen)


def a_query_token_is_no_token(stack: Stack, url: str, tenant: str, *, method: str = "GET",
                              path: str = "/catalog") -> None:
    """Envoy's jwt_authn also reads a token from an ``access_token`` query parameter unless told
    where to look; with a second token there it verified both and added both identities' headers:
    the rate limit service charged the query's (ext_authz refused the doubled header, 422), the
    backend was handed both. Only the Authorization header
    carries the token: a query token alone is no token (401), and beside the header's it is
    ignored — the header's identity is charged, the query's never."""
    other = ISSUER.token("U-78", tenant + "-q", "KQ")
    status, _ = send_raw(url, f"{path}?access_token={other}", method=method)
    assert status == 401, status
    status, upstream = send_raw(url, f"{path}?access_token={other}", identity("U-77", tenant), method=method)
    assert status == 200 and upstream is not None, status
    assert upstream["headers"].get("x-tenant-id", tenant) == tenant, upstream["headers"]
    assert keys(stack, f"rl:v3:{{t:{tenant}-q}}*") == []  # the query's identity: nothing
    assert keys(stack, f"rl:v3:{{t:{tenant}}}*"), "the header's identity was not charged"


def alias_headers_name_nobody(url: str, tenant: str, *, method: str = "GET", path: str = "/catalog") -> None:
    """A backend that reads headers CGI-style (:mod:`tests.support.cgi_backend`: WSGI, PHP, Rack)
    reads ``x_tenant_id`` as ``x-tenant-id``. Envoy removed the client's ``x-tenant-id`` but passed
    its ``x_tenant_id: birch`` on beside the one it set from the token: the backend read the tenant
    as "<token's>,birch" (and the client's alone for a header Envoy does not set, such as
    ``x_service_id``); Traefik forwarded every such name. Header names with an underscore are
    dropped at the edge (Envoy, nginx) or each spelling of the identity, request id, address and
    Leasehold control headers is removed (Traefik, which passed ``x_leasehold_authorization`` and
    the other control headers' spellings on): the backend reads the token's identity and nothing
    of the client's."""
    aliases = {"x_tenant_id": "birch", "x_user_id": "B-1", "x_api_key_id": "KX", "x_service_id": "svc",
               "x_request_id": "client-chosen-id-0003", "x_real_ip": FORGED_IP, "x_forwarded_for": FORGED_IP,
               # the separators mixed, and another letter case: the same variable to the backend
               "X-Tenant_Id": "birch", "x-api_key-id": "KX", "X_SERVICE-ID": "svc", "x_route_group": "export",
               # Leasehold's control headers: the gateway token's name never carries the client's
               "x_leasehold_authorization": "Bearer not-the-gateway", "x-leasehold_cost": "1000",
               "X_Leasehold-Auth_Failed": "true", "x_leasehold_deny-status": "401", "x_leasehold_status": "200"}
    status, upstream = send_raw(url, path, {**identity("U-76", tenant), **aliases}, method=method)
    assert status == 200 and upstream is not None, status
    env = upstream["environ"]
    assert (env["HTTP_X_TENANT_ID"], env["HTTP_X_USER_ID"], env["HTTP_X_API_KEY_ID"]) == (tenant, "U-76", "K1"), env
    assert "HTTP_X_SERVICE_ID" not in env, env
    assert env.get("HTTP_X_ROUTE_GROUP", "") != "export", env
    assert not {"birch", "B-1", "KX", "svc", "client-chosen-id-0003", FORGED_IP, "Bearer not-the-gateway", "1000",
                "401"} & {part for v in env.values() for part in v.split(",")}, env
    assert not [k for k in env if k.startswith("HTTP_X_LEASEHOLD_")], env


# the identity headers a client forges, each twice and in another spelling of its name: another
# tenant, an administrator, another API key, a service principal; and the limiter's own names
FORGED_IDENTITY = (("x-tenant-id", "birch"), ("X-Tenant-Id", "other-tenant"), ("x-user-id", "admin"),
                   ("X-USER-ID", "root"), ("x-api-key-id", "KX"), ("X-Api-Key-Id", "KY"),
                   ("x-service-id", "billing"), ("X-Service-Id", "svc"), ("x-route-group", "export"),
                   ("x-real-ip", FORGED_IP), ("x-forwarded-for", FORGED_IP),
                   ("x-leasehold-cost", "1000"), ("x-leasehold-authorization", "Bearer not-the-gateway"),
                   ("x-leasehold-auth-failed", "false"), ("x-leasehold-deny-status", "401"),
                   ("x-leasehold-status", "200"))
HANDED_ON = ("x-tenant-id", "x-user-id", "x-api-key-id", "x-service-id", "x-route-group")
# Leasehold's own control headers: the gateway's and the agent's words, never the backend's (a backend,
# or a proxy behind the gateway, that read them would be steered by the client)
CONTROL = ("x-leasehold-cost", "x-leasehold-authorization", "x-leasehold-auth-failed", "x-leasehold-deny-status",
           "x-leasehold-status")


def _to_backend(url: str, target: str, headers: list[tuple[str, str]], *, method: str, source: str,
                wait_s: float = 15.0) -> tuple[int, dict | None]:
    """:func:`send_raw` again while the gateway answers 429 (an RLQS Envoy denies a bucket's first
    requests until its assignment comes), bounded."""
    end = time.monotonic() + wait_s
    while True:
        status, upstream = send_raw(url, target, headers, method=method, source=source)
        if status != 429 or time.monotonic() > end:
            return status, upstream
        time.sleep(0.2)


def the_backend_gets_the_verified_identity_only(url: str, tenant: str, source: str) -> None:
    """What the backend is handed with forged identity headers (another tenant, user, API key,
    service, each twice): behind nginx and Traefik it got the client's copies unchanged while the
    limiter charged the token's identity, so a backend that trusts them (as it may behind Envoy,
    which sets them from the verified token) served the client as another tenant or an
    administrator. Every shipped gateway hands the backend exactly the verified identity --
    X-Tenant-Id, X-User-Id and X-Api-Key-Id from the token, on every route that needs one -- and
    nothing of the client's: no X-Service-Id, no X-Route-Group, no forged address, none of
    Leasehold's control headers (``CONTROL``: nginx and Traefik passed the client's on); nothing
    of the identity without a verified token (/login) and no request at all with a bad one."""
    def check(method: str, path: str, extra: list[tuple[str, str]], expected: dict[str, str]) -> None:
        status, upstream = _to_backend(url, path, [*FORGED_IDENTITY, *extra], method=method, source=source)
        assert status == 200 and upstream is not None, (method, path, extra, status)
        got = upstream["headers"]
        assert {k: got[k] for k in HANDED_ON if k in got} == expected, (method, path, extra, got)
        assert not {k: got[k] for k in CONTROL if k in got}, (method, path, extra, got)
        for name in ("x-real-ip", "x-forwarded-for"):  # the connection's address, or nothing
            assert got.get(name, source) == source, (method, path, name, got)

    with_key = ISSUER.token("U-80", tenant, "K1")
    without_key = ISSUER.token("U-81", tenant)
    verified = {"x-tenant-id": tenant, "x-user-id": "U-80", "x-api-key-id": "K1"}
    for method, path in (("GET", "/catalog"), ("POST", "/reports/export")):  # every route that needs a token
        check(method, path, [("authorization", "Bearer " + with_key)], verified)
        check(method, path, [("authorization", "Bearer " + without_key)], {"x-tenant-id": tenant, "x-user-id": "U-81"})
    # a user id that is not ASCII: its UTF-8 bytes, as the token carries it (the demo backend reads Latin-1)
    check("GET", "/catalog", [("authorization", "Bearer " + ISSUER.token("U-82-Zoë", tenant))],
          {"x-tenant-id": tenant, "x-user-id": "U-82-Zoë".encode().decode("latin-1")})
    # the pre-authentication route: no identity is verified there, a valid token or not
    for extra in ([], [("authorization", "Bearer " + with_key)], [("authorization", "Bearer not.a.jwt")]):
        check("POST", "/login", extra, {})
    # a bad token elsewhere never reaches the backend
    for bad in ("Bearer not.a.jwt", DevIssuer().bearer("U-80", tenant)["authorization"]):
        status, upstream = send_raw(url, "/catalog", [*FORGED_IDENTITY, ("authorization", bad)], source=source)
        assert status == 401 and upstream is None, (bad[:20], status, upstream)


# how a client may spell the one header carrying its token: the scheme in any case (RFC 9110 11.1),
# one or more spaces before the token (RFC 6750 2.1: 1*SP)
BEARER_SPELLINGS = ("Bearer {}", "bearer {}", "BEARER {}", "bEaReR {}", "Bearer  {}", "Bearer   {}", "bearer  {}")


def one_token_is_one_identity(stack: Stack, url: str, tenant: str, *, rlqs: bool = False) -> None:
    """However a client spells ``Authorization: Bearer <token>`` (the scheme's case, the spaces
    before the token), its token is its identity: the request passes and that user's limit is spent.
    Envoy's jwt_authn read ``Bearer  <token>`` but not ``bearer <token>`` (401), the agent behind nginx
    and Traefik the other way round: one client, two answers by the gateway in front. ``rlqs``: Envoy
    answers from its quota assignments (a 429 until the bucket's first one arrives is the user's too;
    its bucket is funded later), so any answer but 401 is the identity read."""
    for i, spelling in enumerate(BEARER_SPELLINGS):
        user = f"U-sp{i}"
        status, upstream = send_raw(url, "/catalog", {"authorization": spelling.format(ISSUER.token(user, tenant, "K1"))})
        if rlqs:
            assert status in (200, 429), (spelling, status)
            continue
        assert status == 200 and upstream is not None, (spelling, status)
        assert keys(stack, f"rl:v3:{{t:{tenant}}}:u:{KEYS.h(tenant, 'u', user)}:*"), (spelling, "its user was not charged")
    # a form the RFC does not have is no token, at every door alike: 401
    token = ISSUER.token("U-sp-tab", tenant, "K1")
    for spelling in ("Bearer\t{}", "Bearer{}", "Token {}"):
        status, _ = send_raw(url, "/catalog", {"authorization": spelling.format(token)})
        assert status == 401, (spelling, status)
    assert not keys(stack, f"rl:v3:{{t:{tenant}}}:u:{KEYS.h(tenant, 'u', 'U-sp-tab')}:*")


__all__ = ["AMBIGUOUS_PATHS", "BEARER_SPELLINGS", "CONTROL", "FORGED_IDENTITY", "FORGED_IP", "HANDED_ON",
           "LOGIN_LOOKALIKES", "TEXTLESS_CLAIMS", "UNKEYABLE_CLAIMS", "UPGRADES", "a_query_token_is_no_token",
           "alias_headers_name_nobody", "ambiguous_paths_never_reach_the_backend",
           "an_upgrade_opens_no_tunnel", "claims_that_are_no_header_value_are_refused", "decision_record",
           "forged_forwarding_headers_count_the_connection", "hostile", "ip_keys_of", "keys",
           "no_token_claims_nothing", "one_token_is_one_identity", "p_read_with_hostile_headers",
           "replayed_request_id_is_not_the_clients", "route_group_is_the_routes", "send_raw",
           "the_anonymous_route_is_login_alone", "the_backend_gets_the_verified_identity_only", "tokens",
           "unkeyable_claims_are_refused"]
