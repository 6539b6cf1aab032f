"""Redis client construction for the agent: standalone or Redis Cluster.

``redis://`` / ``rediss://`` URLs give a standalone client; ``redis+cluster://`` (or
``rediss+cluster://``) or ``--redis-cluster`` give a ``RedisCluster`` seeded from that
node. The pool is bounded and connects/reads time out, so a slow store degrades decisions
instead of queueing them. The driver never retries on its own."""

from __future__ import annotations

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


def plain_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return scheme.removesuffix("+cluster") + "://" + rest


CONNECT_TIMEOUT_S = 0.25


def make_client(url: str, *, cluster: bool = False, max_connections: int = 32,
                socket_timeout: float = 1.0) -> Redis | RedisCluster:
    # no driver-level retries: a timed-out script may have run, and a blind resend could debit twice;
    # the engine decides (degrade, or one retry when the call carries a decision record)
    common = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=socket_timeout, decode_responses=False,
                  retry=Retry(NoBackoff(), 0))
    if cluster or is_cluster_url(url):
        return RedisCluster.from_url(plain_url(url), max_connections=max_connections, **common)
    return Redis.from_url(plain_url(url), max_connections=max_connections, **common)


def redacted(url: str) -> str:
    """The URL without credentials, for logs."""
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    if "@" in rest:
        rest = rest.split("@", 1)[1]
    return f"{scheme}://{rest}" if scheme else rest
