"""Redis client construction for the agent: one Redis, a Redis Cluster, or a Sentinel-managed primary.

``--redis-url`` says which (:func:`parse_store_url`):

* ``redis://[user[:password]@]host:port/db`` (``rediss://`` for TLS, ``unix:///path`` for a
  socket): one Redis node;
* ``redis+cluster://[user[:password]@]host:port[,host:port...]`` (or ``--redis-cluster``):
  a Redis Cluster found from those seed nodes; the agent reads its slot map and keeps one
  client per primary (region_agent.store.cluster);
* ``redis+sentinel://[user[:password]@]host:port[,host:port...]/service[/db]``: the primary
  that Redis Sentinels at those addresses name for ``service`` (redis-py's Sentinel support:
  every new connection asks the sentinels where the primary is, so after a failover the agent
  reconnects to the promoted replica). Credentials and the TLS options of the query string apply
  to the Redis nodes and, unless a sentinel password is given, the sentinels are asked without
  one (``--redis-sentinel-password-file`` or ``LEASEHOLD_AGENT_REDIS_SENTINEL_PASSWORD``).

Every client's pool is bounded and connects/reads time out, so a slow store degrades decisions
instead of queueing them. The driver never retries on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from redis.asyncio import Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from . import redis_internals as ri

STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"
CONNECT_TIMEOUT_S = 0.25


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+sentinel")


def plain_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return scheme.removesuffix("+cluster").removesuffix("+sentinel") + "://" + rest


@dataclass(frozen=True)
class StoreUrl:
    """A parsed ``--redis-url``: which kind of store, where, and the options of one Redis node's URL."""

    kind: str  # standalone | cluster | sentinel
    scheme: str  # redis | rediss
    userinfo: str  # "user:password" as written (quoted), or ""
    hosts: tuple[tuple[str, int], ...]
    service: str | None = None  # sentinel: the monitored primary's name
    db: int = 0
    query: str = ""

    def node_url(self, host: str, port: int) -> str:
        """A standalone URL of one node of this store (credentials, db and options kept)."""
        auth = self.userinfo + "@" if self.userinfo else ""
        return f"{self.scheme}://{auth}{_host(host)}:{port}/{self.db}" + (f"?{self.query}" if self.query else "")

    @property
    def names(self) -> list[str]:
        return [f"{h}:{p}" for h, p in self.hosts]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _hostport(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if not host:
        raise ValueError(f"no host in {text!r}")
    try:
        n = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad port in {text!r}") from None
    if not 0 < n < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return host, n


def _check_userinfo(rest: str) -> None:
    """The URL's authority ends at its first ``/``, ``?`` or ``#``: a password holding one of them
    unencoded would be split there, its pieces read as a host, a port or a path, and echoed in
    the errors about them — so that is refused first, naming no part of it. (A ``#`` anywhere
    starts a fragment, which a Redis URL never has.)"""
    if "#" in rest:
        raise ValueError("the Redis URL has a '#' (in a password: write it %23, or give the password in "
                         "LEASEHOLD_AGENT_REDIS_PASSWORD or --redis-password-file)")
    authority = rest
    for stop in "/?":
        authority = authority.split(stop, 1)[0]
    if "@" not in authority and "@" in rest:
        raise ValueError("the Redis URL's user or password has a '/' or '?': percent-encode it (%2F, %3F), or "
                         "give the password in LEASEHOLD_AGENT_REDIS_PASSWORD or --redis-password-file")


def parse_store_url(url: str, *, cluster: bool = False) -> StoreUrl:
    """``ValueError`` with a message naming what is wrong (never the password)."""
    if "://" not in url:
        raise ValueError("expected a URL starting with redis://, rediss://, redis+cluster://, "
                         "redis+sentinel:// or unix://")
    scheme, rest = url.split("://", 1)
    base, _, suffix = scheme.partition("+")
    if base == "unix" and not suffix and not cluster:  # a socket path: one node (redis-py parses the rest)
        if not rest.split("?", 1)[0].strip("/"):
            raise ValueError("a unix:// URL needs the socket's path: unix:///path/to/redis.sock")
        return StoreUrl(STANDALONE, "unix", "", (), query=rest.partition("?")[2])
    if base not in ("redis", "rediss") or suffix not in ("", "cluster", "sentinel"):
        raise ValueError(f"expected a URL starting with redis://, rediss://, redis+cluster://, "
                         f"redis+sentinel:// or unix://, not {scheme}://")
    kind = {"": CLUSTER if cluster else STANDALONE, "cluster": CLUSTER, "sentinel": SENTINEL}[suffix]
    _check_userinfo(rest)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hostlist = netloc.rpartition("@")
    default_port = 26379 if kind == SENTINEL else 6379
    hosts = tuple(_hostport(h.strip(), default_port) for h in hostlist.split(",") if h.strip())
    if not hosts:
        raise ValueError("the Redis URL names no host")
    if kind == STANDALONE and len(hosts) > 1:
        raise ValueError("several hosts need redis+cluster:// or redis+sentinel://")
    parts = [p for p in path.split("/") if p]
    service = None
    if kind == SENTINEL:
        if not parts:
            raise ValueError("a redis+sentinel:// URL needs the service name: redis+sentinel://host:port/<service>[/db]")
        service, parts = unquote(parts[0]), parts[1:]
    if len(parts) > 1:
        raise ValueError("the Redis URL path is /db (sentinel: /service/db)")
    try:
        db = int(parts[0]) if parts else 0
    except ValueError:
        raise ValueError("the Redis database must be a number") from None
    if kind == CLUSTER and db != 0:
        raise ValueError("Redis Cluster has only database 0")
    return StoreUrl(kind, base, userinfo, hosts, service, db, query)


def _common(socket_timeout: float) -> dict[str, Any]:
    # no driver-level retries: a timed-out script may have run, and a blind resend could debit twice;
    # the engine decides (degrade, or one retry when the call carries a decision record)
    return dict(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=socket_timeout, decode_responses=False,
                retry=Retry(NoBackoff(), 0))


def make_client(url: str, *, max_connections: int = 32, socket_timeout: float = 1.0) -> Redis:
    """A client of one Redis node (``redis://`` / ``rediss://``; a cluster or sentinel URL's scheme
    suffix is ignored here: see :func:`make_sentinel_client` and region_agent.store.factory). Its
    pool reconnects a connection the server closed before handing it out (``ri.ConnectionPool``)."""
    pool = ri.ConnectionPool.from_url(plain_url(url), max_connections=max_connections, **_common(socket_timeout))
    return Redis.from_pool(pool)


def make_sentinel_client(u: StoreUrl, *, max_connections: int = 32, socket_timeout: float = 1.0,
                         sentinel_password: str | None = None) -> Redis:
    """A client of the primary the sentinels of ``u`` name for its service (redis-py's
    ``Sentinel.master_for``: its pool asks the sentinels at every new connection)."""
    from redis.asyncio.sentinel import Sentinel

    host, port = u.hosts[0]
    node = {k: v for k, v in parse_url(u.node_url(host, port)).items() if k not in ("host", "port")}
    ssl = node.pop("connection_class", None) is not None  # rediss: SSLConnection
    common = _common(socket_timeout)
    asked = dict(common, password=sentinel_password) if sentinel_password else dict(common)
    if ssl:
        asked.update(ssl=True, **{k: v for k, v in node.items() if k.startswith("ssl_")})
    sentinel = Sentinel(list(u.hosts), sentinel_kwargs=asked, **common)
    return sentinel.master_for(u.service, redis_class=Redis, connection_pool_class=ri.SentinelConnectionPool,
                               max_connections=max_connections, ssl=ssl, **node)


def redacted(url: str) -> str:
    """The URL without credentials, for logs."""
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    if "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}://{rest}" if scheme else rest
