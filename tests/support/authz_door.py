"""The forward-auth door driven without a server: a stand-in for what its handler reads of the
agent's gateways, a development issuer's tokens, and one request through the raw ASGI handler as
uvicorn drives it (tests/unit/region_agent/gateways/)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from leasehold.local.devjwt import DevIssuer
from region_agent.gateways.authz import authz, decision_id_name, identity_memo
from region_agent.gateways.bearer import BearerVerifier
from region_agent.gateways.mapping import Names
from region_agent.gateways.metrics import GatewayMetrics
from region_agent.models import AdmitRequest, Decision

ISSUER = DevIssuer()


class FakeGateways:
    """What the handler reads of ``region_agent.gateways.Gateways``; ``decide`` answers
    ``status`` and records the questions."""

    def __init__(self, bearer: BearerVerifier | None, names: Names | None = None, status: int = 200):
        self.names = names or Names.build()
        self.metrics = GatewayMetrics(CollectorRegistry())
        self.bearer = bearer
        self.anonymous_routes = frozenset({"login"})
        self.identity_answers = identity_memo()
        self.decision_id_name = decision_id_name(self.names)
        self.status = status
        self.asked: list[AdmitRequest] = []

    def gateway_tokens(self) -> None:
        return None  # no gateway authentication in these tests

    async def decide(self, reqs: list[AdmitRequest], **_: Any) -> list[Decision]:
        self.asked.extend(reqs)
        if self.status == 200:
            return [Decision(allowed=True, decision_id=r.request_id, rule_id="read-user-v3", bundle_version=1,
                             headers={"RateLimit": '"read-user-v3";r=19;t=0'}) for r in reqs]
        return [Decision(allowed=False, decision_id=r.request_id, rule_id="read-user-v3", bundle_version=1,
                         http_status=self.status, retry_after_ms=1000, headers={"Retry-After": "1"},
                         problem={"status": self.status}) for r in reqs]


def ask(gw: FakeGateways, headers: list[tuple[bytes, bytes]], route: str = "read",
        path: str = "/v1/authz/catalog", client: str | None = None) -> tuple[int, list[tuple[bytes, bytes]]]:
    """One request through the forward-auth handler as uvicorn drives it (a recording ``send``):
    its status and answer headers (one start message). ``client``: the connection's peer address,
    when the test needs one."""
    scope: dict[str, Any] = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                             "headers": [(b"x-route-group", route.encode()), (b"x-real-ip", b"192.0.2.7"), *headers],
                             "app": SimpleNamespace(state=SimpleNamespace(agent=SimpleNamespace(gateways=gw)))}
    if client is not None:
        scope["client"] = (client, 50412)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(authz.fn(scope, receive, send))  # the mounted handler itself
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1
    return starts[0]["status"], starts[0]["headers"]


def token(user: str, tenant: str = "atlas", key: str | None = "K1") -> tuple[bytes, bytes]:
    return b"authorization", ("Bearer " + ISSUER.token(user, tenant, key)).encode()
