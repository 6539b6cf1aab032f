"""Front doors for real gateways, on the agent's one decision path.

* :mod:`.rls` — Envoy's rate limit service (RLS v3, gRPC) on ``--rls-port``.
* :mod:`.authz` — HTTP forward auth on ``/v1/authz`` (Envoy ext_authz, nginx auth_request,
  Traefik ForwardAuth): the answer is the status code.
* :mod:`.mapping` / :mod:`.answer` — pure translation of their questions and answers.

Both reach the engine through :meth:`Gateways.decide`, which runs exactly what
``POST /v1/admit`` and ``/v1/admit/batch`` run: the pre-engine stage of the app (failed
authentication, stale policy, the new-keys-per-source cap) and then ``Engine.admit`` (one
question) or ``Engine.admit_many`` (several: one pipeline). Same plan, keys, scripts, leases,
fallbacks and decision metrics; no second decision path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernel.errors import Unavailable

from ..models import AdmitRequest, Decision
from .mapping import Names
from .metrics import GatewayMetrics


class Gateways:
    def __init__(self, settings: Any, *, state_of: Callable[[], Any],
                 before_engine: Callable[[Any, list], list], registry: Any):
        self.settings = settings
        self.names = Names.from_settings(settings)
        self.metrics = GatewayMetrics(registry)
        self._state_of = state_of
        self._before = before_engine
        self.rls: Any = None  # .rls.RlsServer while serving

    @property
    def state(self) -> Any:
        return self._state_of()

    def gateway_tokens(self) -> Any:
        auth = self.state.auth
        return auth.gateways if auth is not None else None

    async def decide(self, reqs: list[AdmitRequest]) -> list[Decision]:
        st = self.state
        if st.engine is None:
            raise Unavailable("agent is starting")
        pre = self._before(st, reqs)
        rest = [r for r, d in pre if d is None]
        if len(rest) == 1:
            decided = iter([await st.engine.admit(rest[0])])
        else:
            decided = iter(await st.engine.admit_many(rest) if rest else [])
        return [d if d is not None else next(decided) for _, d in pre]

    async def start(self) -> None:
        s = self.settings
        if not s.rls_port:
            return
        from .rls import RateLimitServicer, RlsServer, server_credentials

        servicer = RateLimitServicer(names=self.names, decide=self.decide,
                                     bundle_of=lambda: self.state.holder.bundle,
                                     gateways=self.gateway_tokens(), metrics=self.metrics)
        tls = (server_credentials(s.rls_tls_cert_file, s.rls_tls_key_file, s.rls_tls_client_ca_file)
               if s.rls_tls_cert_file and s.rls_tls_key_file else None)
        self.rls = await RlsServer(servicer, host=s.rls_host or s.host, port=s.rls_port,
                                   max_concurrent_rpcs=s.rls_max_concurrent_rpcs, tls=tls).start()

    async def stop(self) -> None:
        if self.rls is not None:
            await self.rls.stop()
            self.rls = None


__all__ = ["Gateways"]
