"""The region agent as the tests run it against a real Redis: its settings for an app in the test's
event loop (:func:`make_settings`, with the tests' :data:`PEPPER`), the agent as a real uvicorn
process (:func:`agent_process`: true concurrency, which the in-process test client's portal
serialises), and an admission request's body (:func:`admit_body`, :func:`admit_json`)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from leasehold.local.procs import Proc, free_port, wait_port
from leasehold.local.services import agent_command
from region_agent.service.settings import AgentSettings
from tests.support.policies import ROOT

PEPPER = b"test-pepper-not-secret"


def make_settings(redis_url: str, policy: Path, **kw) -> AgentSettings:
    # these tests rewrite stored state to simulate time, which an in-process negative cache cannot
    # see; the negative cache has its own tests (test_negative_cache.py)
    kw.setdefault("negative_cache_ms", 0)
    # these tests check the worked numbers' exact Retry-After values (max(1, ceil(ms / 1000))): no jitter
    # (its spread: tests/unit/region_agent/decision/test_retry_jitter.py; with it on: the gateway e2e tests)
    kw.setdefault("retry_jitter_max_ms", 0)
    kw.setdefault("auth_disabled", True)  # gateway/operator authentication: tests/integration/security
    return AgentSettings(redis_url=redis_url, policy=str(policy), region="eu", policy_poll_ms=0,
                         decision_budget_ms=kw.pop("decision_budget_ms", 2000), **kw)


def admit_body(request_id: str | None = None, *, tenant: str | None = "atlas", ptype: str = "user",
               pid: str = "U-17", route: str = "read", cost: int = 1, api_key: str | None = "K1") -> dict:
    """One admission's JSON body; a fresh request id unless one is given (a retry repeats its id)."""
    body: dict = {"requestId": request_id or f"r-{uuid.uuid4().hex[:20]}", "principal": {"type": ptype, "id": pid}, "routeGroup": route,
                  "method": "GET", "costHint": cost}
    if api_key is not None:
        body["principal"]["apiKeyId"] = api_key
    if tenant is not None:
        body["tenantId"] = tenant
    return body


async def admit_json(agent, rid: str, **kw) -> dict:
    """POST /v1/admit through the test client; the answer must be a 200 decision."""
    resp = await agent.post("/v1/admit", json=admit_body(rid, **kw))
    assert resp.status_code == 200, resp.text
    return resp.json()


@contextlib.contextmanager
def agent_process(workdir: Path, redis_url: str, policy: Path, *extra: str,
                  ready_path: str | None = None) -> Iterator[tuple[str, Proc]]:
    """The agent as a real uvicorn subprocess; waits for ``/readyz`` and the store's health (Redis
    reached, scripts loaded), or for ``ready_path`` alone (``/healthz`` for an agent whose Redis is
    down on purpose)."""
    paths = (ready_path,) if ready_path else ("/readyz", "/v1/health/store")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_AGENT_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER=PEPPER.decode())
    proc = Proc(f"agent-{port}", agent_command(
        *(() if "--negative-cache-ms" in extra else ("--negative-cache-ms", "0")),
        *(() if "--retry-jitter-max-ms" in extra else ("--retry-jitter-max-ms", "0")),  # the exact hints (make_settings)
        *(() if {"--auth-disabled", "--no-auth-disabled"} & set(extra) else ("--auth-disabled",)), *extra,
        redis_url=redis_url, policy=policy, region="eu", host="127.0.0.1", port=port, policy_poll_ms=0,
        log_level="warning"), workdir, env=env).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        for _ in range(300):  # bounded wait for readiness (scripts loaded)
            with contextlib.suppress(httpx.HTTPError):
                if all(httpx.get(base + p, timeout=2).status_code == 200 for p in paths):
                    break
            time.sleep(0.05)
        else:
            raise RuntimeError("agent never became ready:\n" + proc.tail())
        yield base, proc
    finally:
        proc.stop()
