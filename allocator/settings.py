"""Allocator service settings: ``--flags``, then ``LEASEHOLD_ALLOCATOR_<FIELD>`` env vars, then
defaults (see ``allocator/example.env``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from msgspec import Meta

from kernel.auth import TokenTable
from kernel.config import ConfigError, LogLevel, ServingSettings, check_tls, check_tokens, load_settings
from kernel.ids import EtcdPrefix, NodeId
from kernel.options import Help

ENV_PREFIX = "LEASEHOLD_ALLOCATOR_"


class AllocatorSettings(ServingSettings, forbid_unknown_fields=True, frozen=True):  # (frozen: as inherited)
    """Leasehold allocator: global pools on etcd, epoch-fenced lease grants."""

    etcd: Annotated[str, Help(
        "the etcd cluster holding the pools and grants; https:// endpoints (or any --etcd-*-file) "
        "use TLS", kind="etcd-endpoints", section="Service")]
    policy: Annotated[str, Help("the sealed policy bundle (JSON) whose pools this allocator serves",
                                metavar="FILE")]
    node_id: Annotated[NodeId, Help("this replica's name, unique among the replicas (leader key, shards)")]
    host: Annotated[str, Help("HTTP listen address (0.0.0.0 for every interface)", kind="host")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535), Help("HTTP listen port")] = 8700
    advertise_url: Annotated[str | None, Help(
        "how the other replicas and the regions reach this replica", kind="url", schemes=("http", "https"),
        default="http://<host>:<port>")] = None
    log_level: Annotated[LogLevel, Help("the least severe log records written")] = "info"
    max_body_bytes: Annotated[int, Meta(ge=1_024, le=16 * 1024 * 1024), Help(
        "largest request body accepted; larger: 413")] = 1024 * 1024

    prefix: Annotated[EtcdPrefix, Help(
        "the etcd key prefix of everything this fleet stores", section="etcd")] = "/leasehold/"
    etcd_timeout_ms: Annotated[int, Meta(ge=50, le=30_000), Help("bound on each etcd call")] = 2_000
    etcd_user: Annotated[str | None, Help(
        "etcd user (role limited to --prefix); its password from LEASEHOLD_ALLOCATOR_ETCD_PASSWORD "
        "or --etcd-password-file")] = None
    etcd_password_file: Annotated[str | None, Help(
        "file holding --etcd-user's password (LEASEHOLD_ALLOCATOR_ETCD_PASSWORD wins)", kind="file",
        requires=("etcd_user",))] = None
    etcd_ca_file: Annotated[str | None, Help(
        "TLS to etcd: the CA (PEM) that signed etcd's certificate; implies TLS", kind="file",
        default="grpc's public roots for https://")] = None
    etcd_cert_file: Annotated[str | None, Help(
        "TLS to etcd: client certificate (PEM) for etcd's --client-cert-auth; implies TLS", kind="file",
        requires=("etcd_key_file",))] = None
    etcd_key_file: Annotated[str | None, Help(
        "the private key (PEM) of --etcd-cert-file", kind="file", requires=("etcd_cert_file",))] = None
    etcd_max_txn_ops: Annotated[int, Meta(ge=0, le=100_000), Help(
        "ops per etcd transaction branch (etcd's --max-txn-ops; a grant takes 2): 0 asks the cluster "
        "at start (read-only probes of 1024, 512, 256 ops); N >= 128 uses N")] = 0
    etcd_compaction_interval_s: Annotated[int, Meta(ge=0, le=86_400), Help(
        "compact etcd's history this often to the revision seen one interval before (by shard 0's "
        "leader; 0: off, e.g. when etcd runs --auto-compaction-*)")] = 30

    election_ttl_s: Annotated[int, Meta(ge=2, le=60), Help(
        "leader lease TTL: a dead leader is replaced within about this long",
        section="Leadership")] = 3
    shards: Annotated[int, Meta(ge=1, le=1024), Help(
        "shards of leadership: 1 = one leader for every pool; N > 1 = pools hashed over N shards, "
        "each with its own leader and epoch. The same value on every replica of a prefix (stored in "
        "etcd; a replica with another value refuses to campaign): change it only with every replica "
        "stopped")] = 1

    region_tokens: Annotated[list[str], Help(
        "regions allowed to lease: <region>:<sha256 hex of its bearer token> entries",
        metavar="REGION:SHA256[,...]", section="Authentication")] = []
    region_tokens_file: Annotated[str | None, Help("the same entries, one per line", kind="file")] = None
    auth_disabled: Annotated[bool, Help(
        "local development only: accept unauthenticated lease calls")] = False

    policy_from_etcd: Annotated[bool, Help(
        "follow <prefix>policy/current (strictly higher versions only)", section="Policy")] = True
    policy_reread_ms: Annotated[int, Meta(ge=50, le=600_000), Help(
        "re-read the published bundle this often besides watching it")] = 5_000
    policy_public_keys: Annotated[list[str], Help(
        "Ed25519 public keys (PEM): every bundle (start file and etcd) must be signed by one of them; "
        "two during a key rotation", kind="file")] = []

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


EPILOG = ("Secrets are read from the environment or from files, never from flags: "
          "LEASEHOLD_ALLOCATOR_ETCD_PASSWORD (or --etcd-password-file).")


def load(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> AllocatorSettings:
    s = load_settings(AllocatorSettings, ENV_PREFIX, argv, env=env, prog="python -m allocator", epilog=EPILOG)
    if 0 < s.etcd_max_txn_ops < 128:
        raise ConfigError(f"invalid value {s.etcd_max_txn_ops} for --etcd-max-txn-ops: below etcd's "
                          "default of 128 (0 = ask etcd)")
    check_tls("--etcd-cert-file / --etcd-key-file / --etcd-ca-file", s.etcd_cert_file, s.etcd_key_file,
              s.etcd_ca_file)
    if not s.auth_disabled:
        check_tokens("--region-tokens / --region-tokens-file", s.region_tokens, s.region_tokens_file)
        if not len(TokenTable.parse(s.region_tokens, s.region_tokens_file)):
            # every lease request would be a 401: the agents' fallback allowances for ever, silently
            raise ConfigError("region authentication is on but no region token is configured: give each "
                              "region's token digest with --region-tokens / --region-tokens-file, or "
                              "--auth-disabled (local development only)")
    try:
        etcd_tls(s)
    except ValueError as e:
        raise ConfigError(f"invalid etcd TLS settings for --etcd: {e}") from None
    return s


def etcd_tls(s: AllocatorSettings) -> Any:
    """The TLS credentials of the etcd link (``None``: plaintext)."""
    from kernel.etcd_tls import link_credentials

    return link_credentials(s.etcd, s.etcd_ca_file, s.etcd_cert_file, s.etcd_key_file)
