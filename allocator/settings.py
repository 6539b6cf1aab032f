"""Allocator service settings: ``--flags``, then ``LEASEHOLD_ALLOCATOR_<FIELD>`` env vars, then
defaults (see ``allocator/example.env``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from msgspec import Meta

from kernel.config import ConfigError, ServingSettings, load_settings
from kernel.etcd_store import parse_endpoints
from kernel.ids import EtcdPrefix, NodeId

ENV_PREFIX = "LEASEHOLD_ALLOCATOR_"


class AllocatorSettings(ServingSettings, forbid_unknown_fields=True):
    """Leasehold allocator: global pools on etcd, epoch-fenced lease grants."""

    etcd: str  # comma-separated host:port list
    policy: str  # policy bundle file (its pools section)
    node_id: NodeId
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8700
    advertise_url: str | None = None  # how the other replicas and regions reach this one
    prefix: EtcdPrefix = "/leasehold/"
    election_ttl_s: Annotated[int, Meta(ge=2, le=60)] = 3
    # shards of leadership: 1 = one leader for every pool (key <prefix>leader); N > 1 = pools hashed
    # over N shards, each with its own leader key and epoch, spread over the live replicas. The same
    # value on every replica of a prefix (stored in etcd at <prefix>shards; a replica with another
    # value refuses to campaign): change it only with every replica stopped.
    shards: Annotated[int, Meta(ge=1, le=1024)] = 1
    etcd_timeout_ms: Annotated[int, Meta(ge=50, le=30_000)] = 2_000
    # ops per etcd transaction branch (etcd's --max-txn-ops; a grant takes 2): 0 = ask the cluster at
    # start (read-only probes of 1024, 512, 256 ops; 128 until it answered); N >= 128 = use N
    etcd_max_txn_ops: Annotated[int, Meta(ge=0, le=100_000)] = 0
    # compact etcd's history every this many seconds to the revision seen one interval before (the
    # leader of shard 0 does it; 0 = off, e.g. when etcd runs --auto-compaction-* itself)
    etcd_compaction_interval_s: Annotated[int, Meta(ge=0, le=86_400)] = 30
    max_body_bytes: Annotated[int, Meta(ge=1_024, le=16 * 1024 * 1024)] = 1024 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    region_tokens: list[str] = []  # "<region>:<sha256 hex of its bearer token>" entries
    region_tokens_file: str | None = None  # the same entries, one per line
    auth_disabled: bool = False  # local development only: accept unauthenticated lease calls
    etcd_user: str | None = None  # etcd authentication (role limited to --prefix)
    etcd_ca_file: str | None = None  # TLS to etcd: the CA that signed etcd's certificate
    etcd_cert_file: str | None = None  # optional client certificate (etcd --client-cert-auth)
    etcd_key_file: str | None = None
    etcd_password_file: str | None = None  # or LEASEHOLD_ALLOCATOR_ETCD_PASSWORD
    policy_from_etcd: bool = True  # follow <prefix>policy/current (strictly higher versions only)
    policy_reread_ms: Annotated[int, Meta(ge=50, le=600_000)] = 5_000  # safety-net re-read period
    policy_public_keys: list[str] = []  # Ed25519 public key PEM files: bundles must be signed by one of them

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


def load(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> AllocatorSettings:
    s = load_settings(AllocatorSettings, ENV_PREFIX, argv, env=env, prog="python -m allocator")
    try:
        parse_endpoints(s.etcd)
    except ValueError as e:
        raise ConfigError(f"invalid setting --etcd / {ENV_PREFIX}ETCD: {e}") from None
    if 0 < s.etcd_max_txn_ops < 128:
        raise ConfigError(f"invalid setting --etcd-max-txn-ops / {ENV_PREFIX}ETCD_MAX_TXN_OPS: "
                          f"{s.etcd_max_txn_ops} is below etcd's default of 128 (0 = ask etcd)")
    if s.advertise_url is not None and not s.advertise_url.startswith(("http://", "https://")):
        raise ConfigError(f"invalid setting --advertise-url / {ENV_PREFIX}ADVERTISE_URL: "
                          f"{s.advertise_url!r} must start with http:// or https://")
    return s
