"""Prometheus metrics of the gateway front doors (RLS and RLQS gRPC, /v1/authz), in the agent's
registry (``/metrics``). Bounded labels only: outcomes, reasons and status codes.

Decisions themselves are counted where every decision is counted
(``leasehold_agent_decisions_total``, ``leasehold_agent_decision_seconds``): these count the
calls, the refused ones and how long a whole call took.

The RLS door counts its answered calls in plain Python and moves the counts into these metrics at
every collection (:meth:`GatewayMetrics.add_flush`, as the decision telemetry does): a registry
read — a scrape, ``get_sample_value`` — or, with several workers, the agent's flush into the
shared files, first runs the flush functions, so the values read are exact."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..service.metrics import FlushFirst

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
AUTHZ_CALLERS = ("gateway", "client")  # leasehold_agent_authz_unauthenticated_total's caller values
RLQS_STREAM_REFUSALS = ("not_ready", "exhausted")  # leasehold_agent_rlqs_refused_streams_total's reasons


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        # registered before the door's metrics: a collection of the registry flushes first
        self._flush = FlushFirst()
        r.register(self._flush)
        self.rls_calls = Counter(
            "leasehold_agent_rls_requests_total",
            "RLS ShouldRateLimit calls by outcome (ok | over_limit | unavailable_503 | conflict_409 | invalid | "
            "unauthenticated | not_ready | exhausted | error)", ["outcome"], registry=r)
        self.rls_invalid = Counter("leasehold_agent_rls_invalid_total",
                                   "RLS calls refused with INVALID_ARGUMENT, by reason (unknown_key, ...)",
                                   ["reason"], registry=r)
        self.rls_descriptors = Counter("leasehold_agent_rls_descriptors_total",
                                       "RLS descriptors answered, by code (OK | OVER_LIMIT)", ["code"], registry=r)
        self.rls_latency = Histogram("leasehold_agent_rls_seconds", "RLS call latency inside the agent",
                                     registry=r, buckets=LATENCY_BUCKETS)
        self.rls_group_calls = Histogram(
            "leasehold_agent_rls_group_calls",
            "RLS calls decided together in one admission (calls that arrived while others were in flight, "
            "held up to --rls-group-linger-ms)", registry=r, buckets=GROUP_BUCKETS)
        self.authz_calls = Counter("leasehold_agent_authz_requests_total",
                                   "Forward-auth (/v1/authz) answers by HTTP status", ["status"], registry=r)
        # whose token a 401 was for: every caller's series exported at 0 from the start, so that
        # increase() sees the first refusal (the alerts LeaseholdAuthzGatewayRefused and
        # LeaseholdAuthzUnknownCaller count the gateway's)
        self.authz_unauthenticated = Counter(
            "leasehold_agent_authz_unauthenticated_total",
            "Forward-auth calls answered 401, by whose token was missing or invalid (gateway: the gateway "
            "token, the call refused undecided; client: the client's bearer token with --authz-jwks, the "
            "call decided against its address)", ["caller"], registry=r)
        for caller in AUTHZ_CALLERS:
            self.authz_unauthenticated.labels(caller)
        self.authz_invalid = Counter("leasehold_agent_authz_invalid_total",
                                     "Forward-auth questions refused as malformed, by reason", ["reason"],
                                     registry=r)
        self.authz_latency = Histogram("leasehold_agent_authz_seconds", "Forward-auth call latency inside the agent",
                                       registry=r, buckets=LATENCY_BUCKETS)
        # RLQS: quota assignments Envoys enforce locally (region_agent.gateways.rlqs)
        self.rlqs_streams = Gauge("leasehold_agent_rlqs_streams", "Envoy RLQS streams open", registry=r,
                                  multiprocess_mode="livesum")
        # the cap the streams are refused at, set once from the settings (Gateways): summed over
        # the workers as the streams are, so the two compare (LeaseholdRlqsStreamsNearCap)
        self.rlqs_max_streams = Gauge(
            "leasehold_agent_rlqs_max_streams",
            "--rlqs-max-streams: the RLQS streams one agent process keeps open, summed over the workers as "
            "leasehold_agent_rlqs_streams is; one more is refused RESOURCE_EXHAUSTED (0 when the RLQS door is not "
            "served: no --rls-port, or --no-rlqs)",
            registry=r, multiprocess_mode="livesum")
        # the fullest worker's streams as a fraction of its cap (each worker refuses at its own):
        # what LeaseholdRlqsStreamsNearCap reads, so one full worker is not hidden by empty ones
        self.rlqs_streams_fill = Gauge(
            "leasehold_agent_rlqs_streams_fill",
            "RLQS streams open as a fraction of --rlqs-max-streams, in the agent's fullest worker (each worker "
            "refuses a stream at its own cap: at 1 the next one there is refused RESOURCE_EXHAUSTED; 0 when the "
            "RLQS door is not served)",
            registry=r, multiprocess_mode="livemax")
        self.rlqs_buckets = Gauge("leasehold_agent_rlqs_buckets", "Envoy buckets tracked (per stream)", registry=r,
                                  multiprocess_mode="livesum")
        self.rlqs_reports = Counter("leasehold_agent_rlqs_reports_total", "RLQS usage reports received",
                                    registry=r)
        self.rlqs_usage = Counter("leasehold_agent_rlqs_usage_total",
                                  "Requests Envoys reported deciding locally, by outcome (allowed | denied)",
                                  ["outcome"], registry=r)
        self.rlqs_assignments = Counter(
            "leasehold_agent_rlqs_assignments_total",
            "Bucket actions sent to Envoys, by kind (fresh: new tokens | renewal: more time, no tokens | "
            "end: an assignment ran out unreplaced | deny: refused bucket | revoke: policy change | "
            "abandon: idle bucket)", ["kind"], registry=r)
        self.rlqs_assigned_tokens = Counter("leasehold_agent_rlqs_assigned_tokens_total",
                                            "Tokens in fresh assignments (every one funded first)", registry=r)
        self.rlqs_stranded_tokens = Counter(
            "leasehold_agent_rlqs_stranded_tokens_total",
            "Assigned tokens Envoys did not use before their assignment was replaced or ended (abandoned, "
            "never refunded)", registry=r)
        self.rlqs_rounds = Counter(
            "leasehold_agent_rlqs_rounds_total",
            "Funding rounds by outcome (granted | partial | denied | window_end | error)", ["outcome"], registry=r)
        # a stream refused for its gateway token, each attempt (Envoy opens it again with backoff):
        # unlabelled, so exported at 0 from the start and increase() sees the first (the alerts
        # LeaseholdRlqsGatewayRefused and LeaseholdRlqsUnknownCaller)
        self.rlqs_unauthenticated = Counter(
            "leasehold_agent_rlqs_unauthenticated_total",
            "RLQS streams refused UNAUTHENTICATED: no valid gateway token (each attempt; the stream is never "
            "opened, its Envoy gets no assignment)", registry=r)
        # a stream the RLQS door refused before opening it, for the agent's own reasons (each
        # attempt): not_ready (UNAVAILABLE, the agent has no engine yet), exhausted
        # (RESOURCE_EXHAUSTED, --rlqs-max-streams open). Both series at 0 from the start, so
        # increase() sees the first (LeaseholdRlqsStreamsAtCap). A refusal for the gateway token is
        # rlqs_unauthenticated's, counted there alone
        self.rlqs_refused_streams = Counter(
            "leasehold_agent_rlqs_refused_streams_total",
            "RLQS streams the agent refused before opening them, by reason (not_ready: UNAVAILABLE, the "
            "agent is starting | exhausted: RESOURCE_EXHAUSTED, --rlqs-max-streams open); each attempt, the "
            "stream's Envoy gets no assignment. Refused for the gateway token: "
            "leasehold_agent_rlqs_unauthenticated_total", ["reason"], registry=r)
        for reason in RLQS_STREAM_REFUSALS:
            self.rlqs_refused_streams.labels(reason)
        self.rlqs_refused = Counter("leasehold_agent_rlqs_refused_total",
                                    "Bucket reports refused (answered deny-all), by reason; undecodable: a message "
                                    "that is not a report (its stream ends INVALID_ARGUMENT)", ["reason"], registry=r)

    def add_flush(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before every collection of the registry and at every :meth:`flush`."""
        self._flush.fns.append(fn)

    def flush(self) -> None:
        """Move the counts kept outside the registry into it (the agent's flush runs this too:
        several workers' shared files)."""
        self._flush.collect()
