"""Front doors for real gateways, on the agent's one decision path.

* :mod:`.rls` — Envoy's rate limit service (RLS v3, gRPC) on ``--rls-port``.
* :mod:`.rlqs` — Envoy's rate limit quota service beside it (``--rlqs``): quota assignments Envoy
  enforces locally, funded by the same admission at the assignment's cost (:mod:`.rlqs_mapping`,
  region_agent.leasing.rlqs_funding).
* :mod:`.authz` — HTTP forward auth on ``/v1/authz`` (Envoy ext_authz, nginx auth_request,
  Traefik ForwardAuth): the answer is the status code.
* :mod:`.mapping` / :mod:`.answer` — pure translation of their questions and answers.
* :mod:`.refused_callers` — each door's log line naming a caller refused for its gateway token.

Both ask the agent's one admission (:class:`region_agent.decision.admission.Admission`, the same as
``POST /v1/admit`` and ``/v1/admit/batch``): a decision for every question, a request-id
conflict included — the rate limit service answers it ``OVER_LIMIT``, forward auth 409. Same
plan, keys, scripts, leases, fallbacks and decision metrics; no second decision path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..models import AdmitRequest, Decision
from .authz import decision_id_name, identity_memo
from .mapping import Names
from .metrics import GatewayMetrics


class Gateways:
    def __init__(self, settings: Any, *, state_of: Callable[[], Any], admission: Any, registry: Any):
        self.settings = settings
        self.names = Names.from_settings(settings)
        self.metrics = GatewayMetrics(registry)
        # the RLQS door's cap, exported from the start (0 when the door is not served)
        self.metrics.rlqs_max_streams.set(settings.rlqs_max_streams if settings.rls_port and settings.rlqs else 0)
        self.metrics.rlqs_streams_fill.set(0)
        self._state_of = state_of
        self.admission = admission  # region_agent.decision.admission.Admission
        # /v1/authz: identity from the client's verified bearer token (.bearer), when configured
        self.bearer = None
        if settings.authz_jwks:
            from .bearer import BearerVerifier

            self.bearer = BearerVerifier(settings.authz_jwks, issuer=settings.authz_jwt_issuer,
                                         audience=settings.authz_jwt_audience, claims=settings.authz_jwt_claims,
                                         leeway_s=settings.authz_jwt_leeway_s)
        self.anonymous_routes = frozenset(settings.authz_anonymous_routes)
        self.identity_answers = identity_memo()  # a verified identity's answer headers (.authz)
        self.decision_id_name = decision_id_name(self.names)  # the header an allowed answer's decision id goes in
        self.rls: Any = None  # .rls.RlsServer while serving
        self.rlqs: Any = None  # .rlqs.RlqsService while serving (--rlqs)

    @property
    def state(self) -> Any:
        return self._state_of()

    def gateway_tokens(self) -> Any:
        auth = self.state.auth
        return auth.gateways if auth is not None else None

    async def decide(self, reqs: list[AdmitRequest], *, door: str, carrier: Any = (),
                     decoded: bool = False) -> list[Decision]:
        """The agent's one admission (never raises for a question it can answer), asked at
        ``door`` with the gateway's headers or metadata as ``carrier`` (its trace context);
        ``decoded``: the questions passed the wire types' validation (their id patterns)."""
        return await self.admission.decide(reqs, door=door, carrier=carrier, decoded=decoded)

    async def start(self) -> None:
        s = self.settings
        if not s.rls_port:
            return
        from .rls import RateLimitServicer, RlsServer, server_credentials

        # the admission itself, not :meth:`decide` around it (one coroutine frame less per call or group)
        servicer = RateLimitServicer(names=self.names, decide=self.admission.decide,
                                     decide_one=self.admission.decide_one,
                                     snapshot_of=lambda: self.state.holder.snapshot,
                                     gateways=self.gateway_tokens(), metrics=self.metrics,
                                     group_linger_s=s.rls_group_linger_ms / 1000, group_size=s.batch_max,
                                     max_slots=s.rls_max_concurrent_rpcs)
        tls = (server_credentials(s.rls_tls_cert_file, s.rls_tls_key_file, s.rls_tls_client_ca_file)
               if s.rls_tls_cert_file and s.rls_tls_key_file else None)
        also: tuple = ()
        if s.rlqs:  # Envoy's rate limit quota service beside it (.rlqs)
            from .rlqs import SERVICE as RLQS_SERVICE
            from .rlqs import RlqsService, add_to_server
            from .rlqs_mapping import RlqsNames

            async def fund(reqs: list[AdmitRequest]) -> list[Decision]:  # a funding round: no request's trace
                return await self.decide(reqs, door="rlqs")

            self.rlqs = RlqsService(settings=s, names=RlqsNames.from_settings(s), decide=fund,
                                    state_of=self._state_of, metrics=self.metrics, gateways=self.gateway_tokens())
            service = self.rlqs
            servicer.streams_open = lambda: len(service.streams)  # each holds one of the port's slots
            also = ((RLQS_SERVICE, lambda server: add_to_server(service, server)),)
        self.rls = await RlsServer(servicer, host=s.rls_host or s.host, port=s.rls_port,
                                   streams_per_connection=s.rls_max_streams_per_connection,
                                   max_connections=s.rls_max_connections,
                                   keepalive_ms=s.rls_keepalive_ms, tls=tls, also=also).start()
        if self.rlqs is not None:
            self.rlqs.start()

    async def stop(self) -> None:
        if self.rlqs is not None:
            await self.rlqs.stop()
        if self.rls is not None:
            await self.rls.stop()
            self.rls = None


__all__ = ["Gateways"]
