"""The agent's settings: one Struct, filled by ``load_settings`` from ``--flags`` and
``LEASEHOLD_AGENT_<FIELD>`` environment variables, validated at start."""

from __future__ import annotations

import os
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kernel.auth import TokenTable
from kernel.config import ConfigError, LogLevel, ServingSettings, check_tls, check_tokens, load_settings
from kernel.ids import EtcdPrefix, RegionName
from kernel.options import Help
from kernel.resources import resolve_policy_path

ENV_PREFIX = "LEASEHOLD_AGENT_"
PEPPER_ENV = ENV_PREFIX + "PEPPER"
DEV_PEPPER = b"leasehold-insecure-dev-pepper"
EPILOG = ("Secrets are read from the environment or from files, never from flags: "
          "LEASEHOLD_AGENT_PEPPER (or --pepper-file), LEASEHOLD_AGENT_REDIS_PASSWORD (or "
          "--redis-password-file), LEASEHOLD_AGENT_REDIS_SENTINEL_PASSWORD (or "
          "--redis-sentinel-password-file), LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD (or --policy-etcd-password-file).")


class AgentSettings(ServingSettings, forbid_unknown_fields=True, frozen=True):
    """Leasehold region agent: admission decisions for gateways."""

    region: Annotated[RegionName, Help(
        "this agent's region; names its leases and its share of the global pools",
        section="Service")] = "local"
    host: Annotated[str, Help("HTTP listen address (0.0.0.0 for every interface)", kind="host")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535), Help("HTTP listen port")] = 8080
    workers: Annotated[int, Meta(ge=1, le=64), Help(
        "worker processes (uvicorn), each with its own connections, caches and local allowances")] = 1
    log_level: Annotated[LogLevel, Help("the least severe log records written")] = "info"
    audit_log: Annotated[str, Help(
        "append privileged-bypass (exempt rule) decisions to this file as JSON lines (-: stderr)",
        kind="out-file")] = "leasehold-audit.jsonl"
    agent_id: Annotated[Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z")] | None, Help(
        "this agent's name (canary slices and the decision log name it)")] = None

    decision_log: Annotated[str | None, Help(
        "write sampled decisions to this file as JSON lines, the input of `leasehold policy replay` "
        "(docs/policy.md)", kind="out-file", default="off", section="Decision log")] = None
    decision_log_allow_rate: Annotated[float, Meta(ge=0, le=1), Help(
        "share of allowed decisions logged")] = 0.01
    decision_log_deny_rate: Annotated[float, Meta(ge=0, le=1), Help("share of denials logged")] = 1.0
    decision_log_fallback_rate: Annotated[float, Meta(ge=0, le=1), Help(
        "share of fallback decisions (allowed or denied) logged")] = 1.0
    decision_log_bytes_per_s: Annotated[int, Meta(ge=1_024, le=1 << 30), Help(
        "at most this many bytes per second; a line over it is dropped and counted")] = 262_144
    decision_log_max_bytes: Annotated[int, Meta(ge=65_536, le=1 << 40), Help(
        "rotate the file at this size")] = 64 << 20
    decision_log_backups: Annotated[int, Meta(ge=1, le=1_000), Help(
        "rotated files kept (FILE.1 is the newest)")] = 5

    policy: Annotated[str, Help(
        "the sealed policy bundle (JSON) to start with; the sample is found in the package when "
        "the path does not exist under the working directory", metavar="FILE",
        section="Policy")] = "policies/northstar.json"
    policy_poll_ms: Annotated[int, Meta(ge=0, le=3_600_000), Help(
        "look at the bundle file's mtime this often and reload it when it changed (0: only on SIGHUP)")] = 1000
    policy_public_keys: Annotated[list[str], Help(
        "Ed25519 public keys (PEM): every bundle (start file, reloads, etcd) must be signed by one of "
        "them; two during a key rotation", kind="file")] = []
    policy_etcd: Annotated[str | None, Help(
        "etcd endpoints to follow published bundles from (<policy-etcd-prefix>policy/current); "
        "https:// endpoints use TLS", kind="etcd-endpoints", default="off")] = None
    policy_etcd_prefix: Annotated[EtcdPrefix, Help("the key prefix the bundles are published under")] = "/leasehold/"
    policy_etcd_reread_ms: Annotated[int, Meta(ge=50, le=600_000), Help(
        "re-read the published bundle this often besides watching it (a missed watch event is "
        "caught within this period)")] = 5_000
    policy_etcd_user: Annotated[str | None, Help(
        "etcd user (read-only role on the policy key); its password from "
        "LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD or --policy-etcd-password-file")] = None
    policy_etcd_password_file: Annotated[str | None, Help(
        "file holding --policy-etcd-user's password (LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD wins)",
        kind="file")] = None
    policy_etcd_ca_file: Annotated[str | None, Help(
        "TLS to etcd: the CA (PEM) that signed etcd's certificate; implies TLS",
        kind="file", requires=("policy_etcd",), default="grpc's public roots for https://")] = None
    policy_etcd_cert_file: Annotated[str | None, Help(
        "TLS to etcd: client certificate (PEM) for etcd's --client-cert-auth; implies TLS",
        kind="file", requires=("policy_etcd", "policy_etcd_key_file"))] = None
    policy_etcd_key_file: Annotated[str | None, Help(
        "the private key (PEM) of --policy-etcd-cert-file", kind="file",
        requires=("policy_etcd_cert_file",))] = None

    redis_url: Annotated[str, Help(
        "the region's Redis: redis://[user@]host:port/db, rediss:// (TLS), unix:///path; "
        "redis+cluster://host:port[,host:port...] for Redis Cluster (a breaker per primary); "
        "redis+sentinel://host:port[,host:port...]/service[/db] for the primary Redis Sentinels name; "
        "rediss+... for TLS; the password never goes in the URL", kind="url", metavar="URL",
        schemes=("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel"),
        section="Redis")] = "redis://127.0.0.1:6379/0"
    redis_cluster: Annotated[bool, Help(
        "treat --redis-url as a Redis Cluster node (also implied by a redis+cluster:// URL)")] = False
    redis_password_file: Annotated[str | None, Help(
        "file holding the Redis password (LEASEHOLD_AGENT_REDIS_PASSWORD wins); the URL names only "
        "the ACL user", kind="file")] = None
    redis_ca_file: Annotated[str | None, Help(
        "CA bundle (PEM) that verifies Redis for a rediss:// URL", kind="file")] = None
    redis_sentinel_password_file: Annotated[str | None, Help(
        "file holding the sentinels' password for a redis+sentinel:// URL "
        "(LEASEHOLD_AGENT_REDIS_SENTINEL_PASSWORD wins); the URL's credentials are the Redis nodes'",
        kind="file")] = None
    redis_cluster_refresh_ms: Annotated[int, Meta(ge=100, le=3_600_000), Help(
        "re-read the Redis Cluster slot map this often (and every 0.5 s while a primary's breaker is "
        "open or a slot has no known owner)")] = 10_000
    redis_socket_timeout_ms: Annotated[int, Meta(ge=10, le=60_000), Help(
        "read bound of one pipeline to Redis")] = 500
    redis_max_connections: Annotated[int, Meta(ge=1, le=1024), Help(
        "connections per Redis server in the pool")] = 32
    store_health_ms: Annotated[int, Meta(ge=0, le=600_000), Help(
        "poll INFO (memory, stats, clients, replication) per shard this often for the store metrics, "
        "the shards concurrently, each bounded by 1 s; readiness does not depend on it (0: off)")] = 5_000
    redis_log_interval_ms: Annotated[int, Meta(ge=0, le=3_600_000), Help(
        "log Redis reachability changes at most this often")] = 10_000
    allow_evicting_store: Annotated[bool, Help(
        "start (degraded: logged, leasehold_agent_redis_evicting 1) on a Redis whose maxmemory-policy "
        "is not noeviction, which silently resets enforcement; refused otherwise (docs/store-hygiene.md)")] = False

    decision_budget_ms: Annotated[int, Meta(ge=1, le=10_000), Help(
        "time one decision may take (a batch gets one more per 64 items); a script call not sent "
        "within it is shed as 503 OVERLOADED", section="Decisions and overload")] = 50
    cold_lease_wait_ms: Annotated[int, Meta(ge=0, le=5_000), Help(
        "how long beyond --decision-budget-ms a decision may wait for the first lease of a pool balance "
        "that holds none (its first use, or again after an idle spell) while the allocator answers: "
        "the first request after a quiet spell is slower instead of denied as pool-busy (0: never; "
        "keep it well under the gateways' timeout to the agent)")] = 600
    batch_max: Annotated[int, Meta(ge=1, le=4096), Help(
        "script calls per coalesced pipeline (a larger single request, e.g. /v1/admit/batch, still "
        "goes as one pipeline)")] = 32
    pipelines_in_flight: Annotated[int, Meta(ge=1, le=16), Help(
        "coalesced pipelines sent to Redis concurrently")] = 3
    queue_max: Annotated[int, Meta(ge=1, le=100_000), Help(
        "queued script calls before new ones are shed (503 OVERLOADED)")] = 10_000
    breaker_failures: Annotated[int, Meta(ge=1, le=1_000), Help(
        "consecutive store failures that open the circuit breaker")] = 5
    breaker_open_ms: Annotated[int, Meta(ge=10, le=600_000), Help(
        "the breaker stays open this long, then probes")] = 1_000
    breaker_probes: Annotated[int, Meta(ge=1, le=100), Help("probe calls while the breaker is half-open")] = 2
    fallback_max_keys: Annotated[int, Meta(ge=1, le=1_000_000), Help(
        "per-rule local fallback buckets kept while Redis is unreachable (least recently used "
        "evicted; pool allowances are not counted here)")] = 100_000
    negative_cache_ms: Annotated[int, Meta(ge=0, le=10_000), Help(
        "hold a denial whose retry hint may end early (an exhausted leased pool, a fleet-wide pool's chunk, a fallback "
        "allowance) at most this long without asking Redis (0: no negative cache)")] = 250
    retry_jitter_pct: Annotated[int, Meta(ge=0, le=100), Help(
        "add up to this percentage of a retry hint as jitter, per decision id")] = 10
    retry_jitter_max_ms: Annotated[int, Meta(ge=0, le=600_000), Help("and at most this much jitter")] = 5_000
    retry_jitter_min_ms: Annotated[int, Meta(ge=0, le=60_000), Help(
        "and at least this much (the window clients denied together spread their Retry-After "
        "over; docs/gateways.md)")] = 1_000
    retry_jitter_seed: Annotated[str, Help(
        "keys the per-decision jitter (a hash of this seed and the decision id); agents with the "
        "same seed jitter alike")] = ""

    allocator_urls: Annotated[list[str], Help(
        "the allocator replicas; unset: no global pools from leases (pool rules then deny)",
        kind="url", schemes=("http", "https"), section="Global pools (leases from the allocator)")] = []
    allocator_token_file: Annotated[str | None, Help(
        "file holding this region's bearer token for the allocator", kind="file")] = None
    allocator_timeout_ms: Annotated[int, Meta(ge=10, le=60_000), Help("one attempt of a lease request")] = 500
    allocator_deadline_ms: Annotated[int, Meta(ge=10, le=60_000), Help(
        "all attempts of one lease request together")] = 3_000
    allocator_clock_uncertainty_ms: Annotated[int, Meta(ge=0, le=600_000), Help(
        "bound on |allocator clock - this host's clock| used until the first grant tells the offset "
        "(pool windows are the allocator's)")] = 1_000
    lease_tick_ms: Annotated[int, Meta(ge=10, le=10_000), Help(
        "how often held leases are expired, topped up and reported")] = 100
    lease_warmup: Annotated[bool, Help(
        "at start, lease every pool this region can spend before /readyz answers ready")] = True
    shutdown_report_ms: Annotated[int, Meta(ge=0, le=120_000), Help(
        "on exit, close held leases and report their use to the allocator within this time")] = 3_000

    pepper_file: Annotated[str | None, Help(
        "file holding the HMAC pepper of the Redis keys (LEASEHOLD_AGENT_PEPPER wins); the agent "
        "refuses to start without a pepper", kind="file", section="Authentication and secrets")] = None
    insecure_dev_pepper: Annotated[bool, Help(
        "local development only: use the fixed, public pepper when none is given")] = False
    gateway_tokens: Annotated[list[str], Help(
        "gateways allowed to ask for decisions (/v1/admit, /v1/authz, RLS): <name>:<sha256 hex of "
        "its bearer token> entries", metavar="NAME:SHA256[,...]")] = []
    gateway_tokens_file: Annotated[str | None, Help(
        "the same entries, one per line", kind="file")] = None
    operator_tokens: Annotated[list[str], Help(
        "operators allowed on /v1/leases, /v1/policy and /v1/rlqs: <name>:<sha256 hex> entries",
        metavar="NAME:SHA256[,...]")] = []
    operator_tokens_file: Annotated[str | None, Help("the same entries, one per line", kind="file")] = None
    auth_disabled: Annotated[bool, Help(
        "local development only: check no credentials at all")] = False

    anon_new_keys_per_source: Annotated[int, Meta(ge=0, le=1_000_000), Help(
        "anonymous (per-IP) keys one coarse source may create per window; past it a new key is "
        "denied before Redis (0: no cap)", section="Pre-authentication limits")] = 4_096
    anon_new_keys_window_ms: Annotated[int, Meta(ge=1_000, le=3_600_000), Help(
        "the window of --anon-new-keys-per-source")] = 60_000
    anon_sources_max: Annotated[int, Meta(ge=1, le=10_000_000), Help(
        "coarse sources tracked per window (a request from a new source past it is denied)")] = 100_000
    anon_source_v4_prefix: Annotated[int, Meta(ge=0, le=32), Help(
        "IPv4 prefix length that makes one coarse source")] = 16
    anon_source_v6_prefix: Annotated[int, Meta(ge=0, le=128), Help(
        "IPv6 prefix length that makes one coarse source")] = 32

    rls_port: Annotated[int, Meta(ge=0, le=65535), Help(
        "serve Envoy's rate limit service (RLS v3, gRPC) and gRPC health on this port (0: off); "
        "every worker binds it", section="Gateways")] = 0
    rls_host: Annotated[str | None, Help("RLS listen address", kind="host", default="--host")] = None
    rls_domain: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z"), Help(
        "the only RLS domain accepted (the Envoy filter's domain)")] = "leasehold"
    rls_keys: Annotated[list[str], Help(
        "<field>=<descriptor key> overrides, e.g. client_ip=remote_address",
        metavar="FIELD=KEY[,...]", default="built-in names")] = []
    rls_max_descriptors: Annotated[int, Meta(ge=1, le=64), Help("descriptors per ShouldRateLimit call")] = 8
    rls_max_concurrent_rpcs: Annotated[int, Meta(ge=1, le=100_000), Help(
        "RLS calls being decided and RLQS streams open, at once; beyond: RESOURCE_EXHAUSTED. Only an "
        "authenticated call or stream takes a slot, and a call gives it back once decided")] = 4_096
    rls_max_streams_per_connection: Annotated[int, Meta(ge=1, le=100_000), Help(
        "HTTP/2 streams open at once on one connection to --rls-port (SETTINGS_MAX_CONCURRENT_STREAMS): "
        "what one client can make the port hold, whatever it sends or leaves unread; Envoy opens "
        "another connection past it")] = 128
    rls_max_connections: Annotated[int, Meta(ge=8, le=100_000), Help(
        "most connections open at once to --rls-port (each worker its own); one more is closed as soon as "
        "it is accepted (its client's calls: UNAVAILABLE). Connections already open are never closed by it")] = 128
    rls_keepalive_ms: Annotated[int, Meta(ge=0, le=3_600_000), Help(
        "--rls-port pings each connection this often and closes one whose peer answers no ping within "
        "as long (gone, or reading nothing), with its calls and RLQS streams; 0: never")] = 30_000
    rls_group_linger_ms: Annotated[float, Meta(ge=0, le=20), Help(
        "an RLS call that arrives while others are in flight waits up to this long for more, so "
        "their decisions are made together (one admission, one Redis pipeline); 0: never, and a "
        "call alone never waits")] = 2.0
    rls_tls_cert_file: Annotated[str | None, Help(
        "serve RLS over TLS with this certificate chain (PEM); plaintext when unset", kind="file",
        requires=("rls_tls_key_file",))] = None
    rls_tls_key_file: Annotated[str | None, Help(
        "the private key (PEM) of --rls-tls-cert-file", kind="file", requires=("rls_tls_cert_file",))] = None
    rls_tls_client_ca_file: Annotated[str | None, Help(
        "mutual TLS on the RLS port: require a client certificate signed by this CA (PEM)", kind="file",
        requires=("rls_tls_cert_file",))] = None
    rlqs: Annotated[bool, Help(
        "also serve Envoy's rate limit quota service (RLQS v3, StreamRateLimitQuotas) on --rls-port: "
        "Envoy decides locally from quota assignments funded by what this agent holds "
        "(docs/gateways.md, RLQS)")] = True
    rlqs_domain: Annotated[Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z")] | None, Help(
        "the only RLQS domain accepted (the quota filter's domain)", default="--rls-domain")] = None
    rlqs_keys: Annotated[list[str], Help(
        "<field>=<bucket id key> overrides (fields: tenant, user, service, api_key, route_group)",
        metavar="FIELD=KEY[,...]", default="built-in names")] = []
    rlqs_max_assignment: Annotated[int, Meta(ge=1, le=1_000), Help(
        "tokens of one quota assignment at most (per Envoy and bucket; the bound's RLQS term counts it)")] = 100
    rlqs_max_ttl_s: Annotated[int, Meta(ge=1, le=300), Help(
        "an assignment's time to live at most (Envoy counts it in whole seconds); it is renewed while "
        "its bucket is in use, and never lives past the window its tokens came from")] = 10
    rlqs_delivery_ms: Annotated[int, Meta(ge=0, le=60_000), Help(
        "how late Envoy can receive what the agent sends on an RLQS stream: the shipped envoy-rlqs.yaml "
        "closes a connection that answers no HTTP/2 ping within 1 s of it (pings every 1-1.15 s), so "
        "nothing sent arrives later than 2.15 s; an assignment is renewed only while it has longer than "
        "this to live (a renewal Envoy receives after its own expiry would start full)")] = 2_500
    rlqs_clock_margin_ms: Annotated[int, Meta(ge=0, le=10_000), Help(
        "an assignment ends at least this long before the end of its window on this agent's clock "
        "(clock offsets, the stream's delivery)")] = 250
    rlqs_report_interval_ms: Annotated[int, Meta(ge=100, le=600_000), Help(
        "how often Envoy reports usage (Envoy 1.40 reports every 5 s whatever reporting_interval says); "
        "an assignment is sized for one interval of the bucket's demand")] = 5_000
    rlqs_max_buckets: Annotated[int, Meta(ge=1, le=10_000_000), Help(
        "buckets tracked per Envoy stream; a new bucket past it is refused (denied)")] = 100_000
    rlqs_max_streams: Annotated[int, Meta(ge=1, le=100_000), Help(
        "RLQS streams open at once on this agent process; beyond: RESOURCE_EXHAUSTED (each refused stream "
        "counted as leasehold_agent_rlqs_refused_streams_total{reason=\"exhausted\"}: its Envoy gets no "
        "assignment; the cap is exported as leasehold_agent_rlqs_max_streams). A stream holds one of "
        "--rls-max-concurrent-rpcs for its whole life: below it, the rest stay for RLS calls")] = 1_024
    rlqs_max_agent_buckets: Annotated[int, Meta(ge=1, le=10_000_000), Help(
        "buckets tracked by this agent process across all its Envoy streams (a closed stream's until "
        "its assignments expire); a new bucket past it is refused (denied): what a gateway that reports "
        "ever more buckets, on ever more streams, can make the agent hold")] = 200_000
    rlqs_idle_ms: Annotated[int, Meta(ge=1_000, le=3_600_000), Help(
        "a bucket without requests for this long (and no live assignment) is abandoned: Envoy forgets "
        "it and reports it at once when it is used again")] = 60_000
    authz_headers: Annotated[list[str], Help(
        "<field>=<header name> overrides for /v1/authz", metavar="FIELD=HEADER[,...]",
        default="built-in names")] = []
    authz_route_prefixes: Annotated[list[str], Help(
        "<path prefix>=<route group> entries: the route group from the original path when no "
        "route-group header is sent (longest path-segment prefix wins)", metavar="PREFIX=GROUP[,...]")] = []
    authz_jwks: Annotated[str | None, Help(
        "/v1/authz takes the identity only from the client's bearer JWT, verified against this JWKS "
        "file (the identity provider's public keys; read again when it changes); identity headers are "
        "ignored, and an allowed request's 200 hands the verified identity back for the backend "
        "(nginx, Traefik: docs/gateways.md)", kind="file", default="off: identity headers",
        requires=("authz_jwt_issuer", "authz_jwt_audience"))] = None
    authz_jwt_issuer: Annotated[str | None, Help(
        "the iss claim every token must carry", requires=("authz_jwks",))] = None
    authz_jwt_audience: Annotated[str | None, Help(
        "the aud claim every token must carry", requires=("authz_jwks",))] = None
    authz_jwt_claims: Annotated[list[str], Help(
        "<field>=<claim> overrides of the claims read (fields: tenant, user, api_key)",
        metavar="FIELD=CLAIM[,...]", default="tenant=tenant,user=sub,api_key=api_key")] = []
    authz_jwt_leeway_s: Annotated[int, Meta(ge=0, le=300), Help(
        "clock skew allowed on a token's exp and nbf")] = 30
    authz_anonymous_routes: Annotated[list[str], Help(
        "route groups asked by the caller's address alone, no credential looked at (the "
        "pre-authentication routes, e.g. login)", metavar="GROUP[,...]")] = []

    def __post_init__(self) -> None:
        from ..gateways.mapping import Names
        from ..leasing.rlqs_funding import RENEW_LEAD_MS
        from ..store.client import parse_store_url

        Names.from_settings(self)  # ValueError -> a settings error naming the bad entry
        if self.rls_port and self.rlqs and self.rlqs_max_streams >= self.rls_max_concurrent_rpcs:
            raise ValueError(f"--rlqs-max-streams ({self.rlqs_max_streams}) must be below --rls-max-concurrent-rpcs "
                             f"({self.rls_max_concurrent_rpcs}): streams that hold every slot leave none for RLS calls")
        if self.rls_port and self.rlqs and self.rlqs_delivery_ms + RENEW_LEAD_MS >= self.rlqs_max_ttl_s * 1_000:
            raise ValueError(f"--rlqs-delivery-ms ({self.rlqs_delivery_ms}) leaves no time to renew an assignment of "
                             f"--rlqs-max-ttl-s ({self.rlqs_max_ttl_s} s): a renewal is sent only while the assignment "
                             f"has longer than the delivery bound to live, due {RENEW_LEAD_MS:.0f} ms before that; raise "
                             f"--rlqs-max-ttl-s above {(self.rlqs_delivery_ms + RENEW_LEAD_MS) / 1_000:g} s")
        try:  # the same for the Redis URL
            parse_store_url(self.redis_url, cluster=self.redis_cluster)
        except ValueError as e:
            raise ValueError(f"for --redis-url: {e}") from None
        from kernel.ids import ROUTE_RE

        for route in self.authz_anonymous_routes:
            if not ROUTE_RE.fullmatch(route):
                raise ValueError(f"--authz-anonymous-routes: {route!r} is not a route group ({ROUTE_RE.pattern})")
        if self.authz_jwks and self.authz_jwt_issuer and self.authz_jwt_audience:  # (requires= names a missing one)
            from ..gateways.bearer import BearerVerifier

            BearerVerifier(self.authz_jwks, issuer=self.authz_jwt_issuer, audience=self.authz_jwt_audience,
                           claims=self.authz_jwt_claims)  # the file and the claim names, checked at start


def load_agent_settings(argv: list[str] | None, env: dict[str, str] | None = None) -> AgentSettings:
    s = load_settings(AgentSettings, ENV_PREFIX, argv, env=env, prog="python -m region_agent", epilog=EPILOG)
    check_tls("--rls-tls-cert-file / --rls-tls-key-file / --rls-tls-client-ca-file", s.rls_tls_cert_file,
              s.rls_tls_key_file, s.rls_tls_client_ca_file)
    check_tls("--redis-ca-file", ca=s.redis_ca_file)
    if not s.auth_disabled:
        check_tokens("--gateway-tokens / --gateway-tokens-file", s.gateway_tokens, s.gateway_tokens_file, "gateway")
        check_tokens("--operator-tokens / --operator-tokens-file", s.operator_tokens, s.operator_tokens_file,
                     "operator")
    if s.policy_etcd:
        check_tls("--policy-etcd-cert-file / --policy-etcd-key-file / --policy-etcd-ca-file",
                  s.policy_etcd_cert_file, s.policy_etcd_key_file, s.policy_etcd_ca_file)
        try:
            policy_etcd_tls(s)
        except ValueError as e:
            raise ConfigError(f"invalid etcd TLS settings for --policy-etcd: {e}") from None
    if not s.auth_disabled and not len(TokenTable.parse(s.gateway_tokens, s.gateway_tokens_file,
                                                        default_name="gateway")):
        # every door (/v1/admit, /v1/authz, RLS, RLQS) would answer 401 / UNAUTHENTICATED, and
        # Envoy's fail-open filters would let every request through undecided (checked last: a
        # malformed setting is named first)
        raise ConfigError("gateway authentication is on but no gateway token is configured: give each "
                          "gateway's token digest with --gateway-tokens / --gateway-tokens-file, or "
                          "--auth-disabled (local development only)")
    # the default ``policies/northstar.json`` is found in the package when not under the cwd
    return msgspec.structs.replace(s, policy=resolve_policy_path(s.policy))


def policy_etcd_tls(s: AgentSettings) -> Any:
    """The TLS credentials of the policy watcher's etcd link (``None``: plaintext)."""
    from kernel.etcd_tls import link_credentials

    return link_credentials(s.policy_etcd or "", s.policy_etcd_ca_file, s.policy_etcd_cert_file,
                            s.policy_etcd_key_file)


def resolve_pepper(settings: AgentSettings, env: dict[str, str] | None = None) -> bytes:
    """The HMAC pepper: env var, then --pepper-file, else refuse (unless explicitly insecure)."""
    env = os.environ if env is None else env
    raw = env.get(PEPPER_ENV)
    if raw:
        return raw.encode()
    if settings.pepper_file:
        try:
            with open(settings.pepper_file, "rb") as f:
                data = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read --pepper-file: {e.strerror}") from None
        if not data:
            raise ConfigError("--pepper-file is empty")
        return data
    if settings.insecure_dev_pepper:
        return DEV_PEPPER
    raise ConfigError(f"no pepper: set {PEPPER_ENV} or --pepper-file (or --insecure-dev-pepper for local use)")


def resolve_secret(path: str | None, env_suffix: str, env: dict[str, str] | None = None) -> str | None:
    """A secret from ``LEASEHOLD_AGENT_<env_suffix>`` or a file (stripped); None when neither is set."""
    env = os.environ if env is None else env
    raw = env.get(ENV_PREFIX + env_suffix)
    if raw:
        return raw
    if path:
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError as e:
            raise ConfigError(f"cannot read the secret file for {env_suffix.lower()}: {e.strerror}") from None
    return None


def redis_url_with_secrets(settings: AgentSettings, env: dict[str, str] | None = None) -> str:
    """``--redis-url`` plus the password (env or file) and the CA file for ``rediss://``."""
    from urllib.parse import quote, urlsplit, urlunsplit

    url = settings.redis_url
    password = resolve_secret(settings.redis_password_file, "REDIS_PASSWORD", env)
    parts = urlsplit(url)
    netloc, query = parts.netloc, parts.query
    if password:
        user = netloc.rsplit("@", 1)[0].split(":", 1)[0] if "@" in netloc else "default"
        host = netloc.rsplit("@", 1)[-1]
        netloc = f"{user}:{quote(password, safe='')}@{host}"
    if settings.redis_ca_file:
        query = (query + "&" if query else "") + "ssl_ca_certs=" + quote(settings.redis_ca_file)
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # (urlunsplit would write unix:///path as unix:/path)
    if not netloc:  # unix:///path with only a CA file: keep the empty authority
        return f"{parts.scheme}://{parts.path}?{query}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
