"""Prometheus metrics of the gateway front doors (RLS gRPC and /v1/authz), in the agent's
registry (``/metrics``). Bounded labels only: outcomes, reasons and status codes.

Decisions themselves are counted where every decision is counted
(``leasehold_agent_decisions_total``, ``leasehold_agent_decision_seconds``): these count the
calls, the refused ones and how long a whole call took."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.rls_calls = Counter(
            "leasehold_agent_rls_requests_total",
            "RLS ShouldRateLimit calls by outcome (ok | over_limit | unavailable_503 | conflict_409 | invalid | "
            "unauthenticated | not_ready | error)", ["outcome"], registry=r)
        self.rls_invalid = Counter("leasehold_agent_rls_invalid_total",
                                   "RLS calls refused with INVALID_ARGUMENT, by reason (unknown_key, ...)",
                                   ["reason"], registry=r)
        self.rls_descriptors = Counter("leasehold_agent_rls_descriptors_total",
                                       "RLS descriptors answered, by code (OK | OVER_LIMIT)", ["code"], registry=r)
        self.rls_latency = Histogram("leasehold_agent_rls_seconds", "RLS call latency inside the agent",
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.authz_calls = Counter("leasehold_agent_authz_requests_total",
                                   "Forward-auth (/v1/authz) answers by HTTP status", ["status"], registry=r)
        self.authz_invalid = Counter("leasehold_agent_authz_invalid_total",
                                     "Forward-auth questions refused as malformed, by reason", ["reason"],
                                     registry=r)
        self.authz_latency = Histogram("leasehold_agent_authz_seconds", "Forward-auth call latency inside the agent",
                                       registry=r, buckets=LATENCY_BUCKETS)
