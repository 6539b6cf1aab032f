"""The agent's settings: one Struct, filled by ``load_settings`` from ``--flags`` and
``LEASEHOLD_AGENT_<FIELD>`` environment variables, validated at start."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec
from msgspec import Meta

from kernel.config import ConfigError, ServingSettings, load_settings
from kernel.ids import EtcdPrefix, RegionName
from kernel.resources import resolve_policy_path

ENV_PREFIX = "LEASEHOLD_AGENT_"
PEPPER_ENV = ENV_PREFIX + "PEPPER"
DEV_PEPPER = b"leasehold-insecure-dev-pepper"


class AgentSettings(ServingSettings, forbid_unknown_fields=True, frozen=True):
    """Leasehold region agent: admission decisions for gateways."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False  # also implied by a redis+cluster:// URL
    redis_password_file: str | None = None  # or LEASEHOLD_AGENT_REDIS_PASSWORD; the URL names only the ACL user
    redis_ca_file: str | None = None  # CA bundle for a rediss:// URL
    redis_sentinel_password_file: str | None = None  # or LEASEHOLD_AGENT_REDIS_SENTINEL_PASSWORD (redis+sentinel://)
    redis_cluster_refresh_ms: Annotated[int, Meta(ge=100, le=3_600_000)] = 10_000  # re-read the cluster's slot map
    policy: str = "policies/northstar.json"
    region: RegionName = "local"
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    workers: Annotated[int, Meta(ge=1, le=64)] = 1
    policy_poll_ms: Annotated[int, Meta(ge=0, le=3_600_000)] = 1000  # 0 disables polling
    policy_etcd: str | None = None  # etcd endpoints: follow <policy_etcd_prefix>policy/current
    policy_etcd_prefix: EtcdPrefix = "/leasehold/"
    policy_etcd_reread_ms: Annotated[int, Meta(ge=50, le=600_000)] = 5_000  # safety-net re-read period
    policy_etcd_user: str | None = None  # etcd user (read-only role on the policy key)
    policy_etcd_password_file: str | None = None  # or LEASEHOLD_AGENT_POLICY_ETCD_PASSWORD
    policy_public_keys: list[str] = []  # Ed25519 public key PEM files: bundles must be signed by one of them
    agent_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z")] | None = None  # canary slices name it
    # the sampled decision log (region_agent/decision_log.py, docs/policy.md): off unless a file is given
    decision_log: str | None = None
    decision_log_allow_rate: Annotated[float, Meta(ge=0, le=1)] = 0.01
    decision_log_deny_rate: Annotated[float, Meta(ge=0, le=1)] = 1.0
    decision_log_fallback_rate: Annotated[float, Meta(ge=0, le=1)] = 1.0
    decision_log_bytes_per_s: Annotated[int, Meta(ge=1_024, le=1 << 30)] = 262_144
    decision_log_max_bytes: Annotated[int, Meta(ge=65_536, le=1 << 40)] = 64 << 20  # rotated at this size
    decision_log_backups: Annotated[int, Meta(ge=1, le=1_000)] = 5
    audit_log: str = "leasehold-audit.jsonl"  # JSON lines of privileged-bypass (exempt rule) decisions ("-": stderr)
    store_health_ms: Annotated[int, Meta(ge=0, le=600_000)] = 5_000  # INFO poll per shard (0 disables)
    retry_jitter_pct: Annotated[int, Meta(ge=0, le=100)] = 10  # upward retry-hint jitter, % of the hint
    retry_jitter_max_ms: Annotated[int, Meta(ge=0, le=600_000)] = 5_000  # ... and at most this much
    retry_jitter_seed: str = ""  # keys the per-decision jitter (hash of seed and decisionId)
    decision_budget_ms: Annotated[int, Meta(ge=1, le=10_000)] = 50
    redis_socket_timeout_ms: Annotated[int, Meta(ge=10, le=60_000)] = 500  # a pipeline's read bound
    redis_max_connections: Annotated[int, Meta(ge=1, le=1024)] = 32
    batch_max: Annotated[int, Meta(ge=1, le=4096)] = 32  # script calls per coalesced pipeline (a larger
    # single request, e.g. /v1/admit/batch, still goes as one pipeline)
    pipelines_in_flight: Annotated[int, Meta(ge=1, le=16)] = 3  # coalesced pipelines sent concurrently
    queue_max: Annotated[int, Meta(ge=1, le=100_000)] = 10_000  # queued script calls before shedding
    breaker_failures: Annotated[int, Meta(ge=1, le=1_000)] = 5  # consecutive store failures that open it
    breaker_open_ms: Annotated[int, Meta(ge=10, le=600_000)] = 1_000  # open for this long, then probe
    breaker_probes: Annotated[int, Meta(ge=1, le=100)] = 2  # probe calls while half-open
    redis_log_interval_ms: Annotated[int, Meta(ge=0, le=3_600_000)] = 10_000  # reachability lines at most this often
    fallback_max_keys: Annotated[int, Meta(ge=1, le=1_000_000)] = 100_000
    allocator_urls: list[str] = []  # empty: no global pools from leases (pool rules then deny)
    allocator_token_file: str | None = None  # this region's bearer token for the allocator
    allocator_timeout_ms: Annotated[int, Meta(ge=10, le=60_000)] = 500  # per attempt
    allocator_deadline_ms: Annotated[int, Meta(ge=10, le=60_000)] = 3_000  # all attempts of one lease request
    lease_tick_ms: Annotated[int, Meta(ge=10, le=10_000)] = 100
    shutdown_report_ms: Annotated[int, Meta(ge=0, le=120_000)] = 3_000  # on exit: close held leases, report them
    # bound on |allocator clock - this host's wall clock| before the first grant tells the offset
    # (pool windows are the allocator's: fallback allowances are counted on its clock)
    allocator_clock_uncertainty_ms: Annotated[int, Meta(ge=0, le=600_000)] = 1_000
    lease_warmup: bool = True  # at start, lease every pool this region can spend before /readyz says ready
    negative_cache_ms: Annotated[int, Meta(ge=0, le=10_000)] = 250  # 0 disables the negative cache
    pepper_file: str | None = None
    gateway_tokens: list[str] = []  # "<gateway name>:<sha256 hex of its bearer token>" entries
    gateway_tokens_file: str | None = None  # the same, one per line
    operator_tokens: list[str] = []  # operator credentials for /v1/leases and /v1/policy
    operator_tokens_file: str | None = None
    auth_disabled: bool = False  # local development only: no credentials checked
    anon_new_keys_per_source: Annotated[int, Meta(ge=0, le=1_000_000)] = 4_096  # 0: no cap (region_agent.preauth)
    anon_new_keys_window_ms: Annotated[int, Meta(ge=1_000, le=3_600_000)] = 60_000
    anon_sources_max: Annotated[int, Meta(ge=1, le=10_000_000)] = 100_000
    anon_source_v4_prefix: Annotated[int, Meta(ge=0, le=32)] = 16
    anon_source_v6_prefix: Annotated[int, Meta(ge=0, le=128)] = 32
    insecure_dev_pepper: bool = False
    log_level: str = "info"
    # gateways (region_agent/gateways, README "Gateways"): Envoy RLS v3 over gRPC and /v1/authz forward auth
    rls_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # 0: no RLS server
    rls_host: str | None = None  # default: --host
    rls_domain: Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{1,64}\Z")] = "leasehold"  # the filter's domain
    rls_keys: list[str] = []  # "<field>=<descriptor key>" overrides, e.g. client_ip=remote_address
    rls_max_descriptors: Annotated[int, Meta(ge=1, le=64)] = 8  # per ShouldRateLimit call
    rls_max_concurrent_rpcs: Annotated[int, Meta(ge=1, le=100_000)] = 4_096  # beyond: RESOURCE_EXHAUSTED
    authz_headers: list[str] = []  # "<field>=<header name>" overrides for /v1/authz
    authz_route_prefixes: list[str] = []  # "<path prefix>=<route group>": the route group from the original path

    def __post_init__(self) -> None:
        from .gateways.mapping import Names
        from .store.client import parse_store_url

        Names.from_settings(self)  # ValueError -> a settings error naming the bad entry
        parse_store_url(self.redis_url, cluster=self.redis_cluster)  # the same for the Redis URL


def load_agent_settings(argv: list[str] | None, env: dict[str, str] | None = None) -> AgentSettings:
    s = load_settings(AgentSettings, ENV_PREFIX, argv, env=env, prog="python -m region_agent")
    # the default ``policies/northstar.json`` is found in the package when not under the cwd
    return msgspec.structs.replace(s, policy=resolve_policy_path(s.policy))


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
    raise ConfigError(f"no pepper: set {PEPPER_ENV} or --pepper-file (or --insecure-dev-pepper true for local use)")


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
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
