"""Who may call the agent.

* Gateways — ``/v1/admit``, ``/v1/admit/batch``, ``/v1/release``, ``/v1/renew`` — with their own bearer tokens.
* Operators — ``/v1/leases``, ``/v1/policy``, ``/v1/rlqs`` — with an operator token (a gateway token is not one).
* Probes and metrics — ``/healthz``, ``/readyz``, ``/metrics`` — and the OpenAPI schema are open;
  they carry no secrets, keys or tenant data.

Tokens are configured as sha256 digests only (see :mod:`kernel.auth`). ``--auth-disabled``
turns the check off, for local development only; it is never the default.
"""

from __future__ import annotations

from typing import Any

from kernel.auth import SCOPE_KEY, TokenTable, authenticate

from .settings import AgentSettings

GATEWAY_PATHS = frozenset({"/v1/admit", "/v1/admit/batch", "/v1/release", "/v1/renew"})
OPERATOR_PATHS = frozenset({"/v1/leases", "/v1/policy", "/v1/rlqs"})


class AgentAuth:
    def __init__(self, gateways: TokenTable, operators: TokenTable):
        self.gateways = gateways
        self.operators = operators

    @classmethod
    def from_settings(cls, s: AgentSettings) -> AgentAuth | None:
        if s.auth_disabled:
            return None
        return cls(TokenTable.parse(s.gateway_tokens, s.gateway_tokens_file, default_name="gateway"),
                   TokenTable.parse(s.operator_tokens, s.operator_tokens_file, default_name="operator"))

    def check(self, path: str, raw_headers: Any) -> str | None:
        """The caller's name, or None for an open path; raises Unauthorized. ``raw_headers`` is
        the ASGI header list (the guard and the fast path read the same one)."""
        if path in GATEWAY_PATHS:
            return "gateway:" + authenticate(self.gateways, raw_headers)
        if path in OPERATOR_PATHS:
            return "operator:" + authenticate(self.operators, raw_headers)
        return None


async def agent_guard(connection: Any, handler: Any) -> None:
    """App-wide Litestar guard: runs before the body is read, so an unauthenticated request
    never reaches validation, the engine or Redis."""
    auth: AgentAuth | None = connection.app.state.agent.auth
    if auth is None:
        return
    who = auth.check(connection.scope["path"], connection.scope["headers"])
    if who is not None:
        connection.scope[SCOPE_KEY] = who
