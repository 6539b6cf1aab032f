"""Real gateways in front of a real agent: a redis-server, a region agent process (RLS gRPC port
and /v1/authz, gateway authentication on), the tiny demo upstream, and Envoy / nginx / Traefik
configured from the files under ``deploy/gateways/`` (only ports, hosts, the gateway token and
the identity provider's JWKS file, issuer and audience are filled in). One stack per test
module; every process is stopped by PID.

Clients hold bearer tokens of a development identity provider (:class:`leasehold.local.devjwt.DevIssuer`,
one key pair per test session): :func:`identity` is the ``Authorization`` header of a user."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from leasehold.local.devjwt import DevIssuer
from leasehold.local.gateways import Envoy, Nginx, Traefik, render, tracing_values, upstream
from leasehold.local.procs import LOOPBACK, Proc, RedisServer, free_port, wait_http_ready, wait_port
from leasehold.local.services import agent_command
from region_agent.decision.keys import KeyBuilder
from region_agent.service.settings import DEV_PEPPER
from tests.support.redis_buckets import FROZEN_AHEAD_MS, user_key

ROOT = Path(__file__).resolve().parents[3]
NORTHSTAR = ROOT / "policies" / "northstar.json"
KEYS = KeyBuilder(DEV_PEPPER)
ISSUER = DevIssuer()  # the identity provider of every test client


@dataclass
class Stack:
    redis: RedisServer
    agent: Proc
    http_port: int
    rls_port: int
    upstream: Proc
    upstream_port: int
    token: str
    workdir: Path
    jwks: Path

    @property
    def agent_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    def values(self, **extra: object) -> dict[str, object]:
        """The placeholders of deploy/gateways/* for this stack."""
        return {"AGENT_HOST": LOOPBACK, "AGENT_HTTP_PORT": self.http_port, "AGENT_RLS_PORT": self.rls_port,
                "UPSTREAM_HOST": LOOPBACK, "UPSTREAM_PORT": self.upstream_port, "GATEWAY_TOKEN": self.token,
                **ISSUER.values(self.jwks), **tracing_values(), **extra}

    def envoy(self, name: str, template: str, **extra: object) -> Envoy:
        """An Envoy on ``template``; ``extra`` overrides placeholders (e.g. another ``UPSTREAM_PORT``)."""
        port, admin = free_port(), free_port()
        cfg = render(template, **self.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin,
                                             **extra))
        return Envoy(name, cfg, self.workdir / name, port, admin).start()

    def nginx(self, name: str = "nginx", **extra: object) -> Nginx:
        """An nginx on ``nginx.conf``; ``extra`` overrides placeholders (e.g. another ``UPSTREAM_PORT``)."""
        port = free_port()
        cfg = render("nginx.conf", **self.values(NGINX_LISTEN_HOST=LOOPBACK, NGINX_PORT=port, **extra))
        return Nginx(name, cfg, self.workdir / name, port).start()

    def traefik(self, name: str = "traefik", **extra: object) -> Traefik:
        """A Traefik on ``traefik.yml``; ``extra`` overrides placeholders (e.g. another ``UPSTREAM_PORT``)."""
        port = free_port()
        return Traefik(name, render("traefik.yml", **self.values(**extra)), self.workdir / name, port).start()

    def full_frozen_bucket(self, user: str, route: str = "read", tenant: str = "atlas") -> None:
        """The user's P-READ bucket full (20 tokens) and stamped in the future: no refill while
        the test runs, so 20 pass and the 21st is denied however slowly the machine runs."""
        r = Redis(port=self.redis.port)
        sec, usec = r.time()
        key = user_key(tenant, user, route, keys=KEYS)
        r.hset(key, mapping={"tokens": 20_000, "ts": int(sec) * 1000 + int(usec) // 1000 + FROZEN_AHEAD_MS})
        r.pexpire(key, 600_000)
        r.close()

    def metric(self, name: str, **labels: str) -> float:
        return agent_metric(self.agent_url, name, **labels)

    @contextmanager
    def second_agent(self, name: str, *flags: str) -> Iterator[tuple[int, int]]:
        """Another agent on this stack's Redis, policy and gateway token, with ``flags`` added;
        yields its HTTP and RLS ports, and stops it after."""
        http_port, rls_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
        env["PYTHONPATH"] = str(ROOT)
        proc = Proc(name, agent_command(
            *flags, "--log-level", "warning", redis_url=self.redis.url,
            policy=ROOT / "policies" / "northstar.json", region="eu", host=LOOPBACK, port=http_port,
            rls_port=rls_port, policy_poll_ms=0, insecure_dev_pepper=True, auth_disabled=False,
            gateway_tokens=["edge:" + hashlib.sha256(self.token.encode()).hexdigest()]),
            Path(self.workdir) / name, env=env).start()
        try:
            wait_http_ready({f"http://{LOOPBACK}:{http_port}": proc}, timeout=60)
            wait_port(rls_port, proc=proc.popen, timeout=30)
            yield http_port, rls_port
        finally:
            proc.stop()


def agent_metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of an agent's series ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(base_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


@pytest.fixture(scope="module")
def extra_agent_args() -> tuple[str, ...]:
    """Agent flags a test module adds (e.g. Traefik's client address header)."""
    return ()


@pytest.fixture(scope="module")
def bearer_at_the_agent() -> bool:
    """The agent verifies the clients' bearer tokens itself (``--authz-jwks``: the nginx and
    Traefik configurations); False: the gateway did (Envoy ``jwt_authn``) and sends headers."""
    return False


@pytest.fixture(scope="module")
def policy() -> Path:
    """The bundle the module's agent runs."""
    return NORTHSTAR


def jwt_agent_args(jwks: Path) -> tuple[str, ...]:
    """The agent flags the nginx and Traefik configurations name: identity from the verified token."""
    return ("--authz-jwks", str(jwks), "--authz-jwt-issuer", ISSUER.issuer, "--authz-jwt-audience", ISSUER.audience,
            "--authz-anonymous-routes", "login")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, extra_agent_args: tuple[str, ...], bearer_at_the_agent: bool,
          policy: Path) -> Iterator[Stack]:
    work = Path(tmp_path_factory.mktemp("gw"))
    jwks = ISSUER.write_jwks(work / "jwks.json")
    redis = RedisServer(work / "redis").start()
    token = secrets.token_urlsafe(24)
    http_port, rls_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env["PYTHONPATH"] = str(ROOT)
    bearer = jwt_agent_args(jwks) if bearer_at_the_agent else ()
    agent = Proc("agent", agent_command(
        *extra_agent_args, *bearer, "--log-level", "warning", redis_url=redis.url, policy=policy, region="eu",
        host=LOOPBACK, port=http_port, rls_port=rls_port, policy_poll_ms=0, insecure_dev_pepper=True,
        auth_disabled=False, gateway_tokens=["edge:" + hashlib.sha256(token.encode()).hexdigest()],
        decision_budget_ms=200), work / "agent", env=env).start()
    up = None
    try:
        up, up_port = upstream(work / "upstream")
        wait_http_ready({f"http://{LOOPBACK}:{http_port}": agent}, timeout=60)
        wait_port(rls_port, proc=agent.popen, timeout=30)
        yield Stack(redis, agent, http_port, rls_port, up, up_port, token, work, jwks)
    finally:
        if up is not None:
            up.stop()
        agent.stop()
        redis.stop()


def identity(user: str, tenant: str = "atlas", key: str | None = "K1") -> dict[str, str]:
    """The bearer token of a client holding that identity (the only way to claim one)."""
    return ISSUER.bearer(user, tenant, key)


def assert_p_read(responses: list[httpx.Response]) -> None:
    """The worked P-READ numbers at the client: 20 pass, the 21st is 429 with Retry-After 1 (or 2:
    the jitter spreads clients denied together over about a second) and the RateLimit fields of
    the caller's own user rule."""
    assert [r.status_code for r in responses] == [200] * 20 + [429], [r.status_code for r in responses]
    for i, r in enumerate(responses[:20]):
        assert r.json()["upstream"] == "upstream"  # the backend answered
        assert r.headers["ratelimit-policy"] == '"read-user-v3";q=20;w=10'
        assert r.headers["ratelimit"] == f'"read-user-v3";r={19 - i};t=0'
    denied = responses[20]
    assert denied.headers["retry-after"] in ("1", "2")  # the 500 ms hint, spread upward over about 1 s
    assert denied.headers["ratelimit-policy"] == '"read-user-v3";q=20;w=10'
    assert denied.headers["ratelimit"] == '"read-user-v3";r=0;t=1'


EXPORT_CAP = 3  # export-tenant's concurrencyMax in policies/northstar.json: exports in flight per tenant


def the_backend_ends_its_export(stack: Stack, url: str, tenant: str) -> None:
    """An export holds one of its tenant's concurrency slots until the backend ends it with
    ``POST /v1/release {"requestId": <the decision id>, ...}``: the backend must be handed the id
    the export was decided under. ``EXPORT_CAP`` exports of ``tenant`` are admitted and one more is
    refused at the cap; the backend releases the first with the X-Request-Id, X-Tenant-Id and
    X-User-Id it received, and the next export is admitted at once (behind Traefik the backend got
    no request id, so the slot was held until it expired: the tenant's export cap spent for 60 s)."""
    with httpx.Client(base_url=url, timeout=10) as c:
        admitted = [c.post("/reports/export", headers=identity("U-90", tenant)) for _ in range(EXPORT_CAP)]
        assert [r.status_code for r in admitted] == [200] * EXPORT_CAP, [r.status_code for r in admitted]
        refused = c.post("/reports/export", headers=identity("U-90", tenant))
        assert refused.status_code == 429, refused.status_code  # the cap: every slot is held
        got = admitted[0].json()["headers"]  # what the backend was handed
        assert got.get("x-request-id"), ("the backend was handed no decision id", got)
        release = httpx.post(stack.agent_url + "/v1/release", timeout=10,
                             headers={"authorization": f"Bearer {stack.token}"},
                             json={"requestId": got["x-request-id"], "tenantId": got["x-tenant-id"],
                                   "principal": {"type": "user", "id": got["x-user-id"]}, "routeGroup": "export"})
        assert release.status_code == 200 and release.json()["released"] == 1, release.text
        again = c.post("/reports/export", headers=identity("U-90", tenant))
        assert again.status_code == 200, (again.status_code, again.text)


# ----------------------------------------------------------------------------- Envoys on envoy-rlqs.yaml
def rlqs_envoy(stack: Stack, name: str, rls_port: int | None = None, token: str | None = None) -> Envoy:
    """An Envoy on the shipped ``envoy-rlqs.yaml`` in front of the stack's agent (its RLS port, or
    ``rls_port``; the stack's gateway token, or ``token``), its access log in its work directory."""
    port, admin = free_port(), free_port()
    log = stack.workdir / name / "access.log"
    values = stack.values(ENVOY_LISTEN_HOST=LOOPBACK, ENVOY_PORT=port, ENVOY_ADMIN_PORT=admin, ENVOY_ACCESS_LOG=log)
    if rls_port is not None:
        values["AGENT_RLS_PORT"] = rls_port
    if token is not None:
        values["GATEWAY_TOKEN"] = token
    return Envoy(name, render("envoy-rlqs.yaml", **values), stack.workdir / name, port, admin).start()


def rlqs_envoy_pair(stack: Stack, prefix: str) -> Iterator[tuple[Envoy, Envoy]]:
    """Two such Envoys (``<prefix>-a``, ``<prefix>-b``) for a module fixture to yield; both stopped
    after it, the first also when the second fails to start."""
    a = rlqs_envoy(stack, f"{prefix}-a")
    try:
        b = rlqs_envoy(stack, f"{prefix}-b")
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def access_log(envoy: Envoy, expect: int) -> list[dict]:
    """Envoy's own record of what it decided (it flushes about every second): at least
    ``expect`` lines, waited for (bounded)."""
    path = envoy.workdir / "access.log"
    lines: list[dict] = []
    for _ in range(100):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        if len(lines) >= expect:
            break
        time.sleep(0.1)
    return lines


def hammer(envoy: Envoy, user: str, *, seconds: float, every_s: float = 0.1) -> list[int]:
    """One client asking as ``user`` every ``every_s`` for ``seconds`` (at most that many requests),
    on a fixed schedule: a slow answer (a loaded machine) delays the next request, not the rate."""
    codes: list[int] = []
    start = time.monotonic()
    end = start + seconds
    with httpx.Client(base_url=envoy.url, timeout=10) as c:
        for i in range(int(seconds / every_s) + 1):
            if time.monotonic() >= end:
                break
            codes.append(c.get("/catalog", headers=identity(user)).status_code)
            time.sleep(max(0.0, start + (i + 1) * every_s - time.monotonic()))
    return codes


@contextmanager
def in_front_of(backend: Any, start: Callable[..., Any], name: str, *args: Any, **values: Any) -> Iterator[Any]:
    """A gateway started by ``start`` (a :class:`Stack` method: ``stack.nginx``, ``stack.traefik``,
    ``stack.envoy``) in front of ``backend`` (one of tests/support's backends: ``.port``, ``.stop()``)
    instead of the demo upstream; the gateway, then the backend, stopped after."""
    try:
        gateway = start(name, *args, UPSTREAM_PORT=backend.port, **values)
        try:
            yield gateway
        finally:
            gateway.stop()
    finally:
        backend.stop()
