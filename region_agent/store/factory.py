"""The agent's store from its settings: one :class:`RedisNode` for a standalone Redis or a
Sentinel-managed primary, a :class:`ClusterStore` (one node per primary) for Redis Cluster —
each node with its own circuit breaker, and the per-shard metrics wired to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernel.config import ConfigError

from ..service.metrics import AgentMetrics
from ..service.settings import AgentSettings, redis_url_with_secrets, resolve_secret
from . import scripts as sc
from .breaker import CircuitBreaker
from .client import CLUSTER, SENTINEL, make_client, make_sentinel_client, parse_store_url
from .cluster import ClusterStore
from .lag import LoopLag
from .node import RedisNode
from .slots import SlotMap

DEFAULT_SHARD = "default"
TOPOLOGY_TIMEOUT_S = 0.5  # one CLUSTER SLOTS read


class ShardMetrics:
    """The per-shard series of one store: breaker state and outages, and (Redis Cluster) the
    slots each primary owns; a primary that left the slot map loses its series."""

    def __init__(self, m: AgentMetrics):
        self.m = m

    def attach(self, shard: str, also: Callable[[bool], None] | None = None) -> dict[str, Any]:
        """The node callbacks for ``shard`` (``also``: told about outages too)."""
        gauge = self.m.breaker_state.labels(shard)
        gauge.set(0)
        opens = self.m.breaker_opens.labels(shard)

        def reachability(up: bool) -> None:
            if not up:
                opens.inc()
            if also is not None:
                also(up)

        return {"on_breaker": gauge.set, "on_reachability": reachability}

    def topology(self, slot_map: SlotMap) -> None:
        counts = slot_map.slot_counts()
        for shard, n in counts.items():
            self.m.redis_slots.labels(shard).set(n)

    def detach(self, shard: str) -> None:
        for metric in (self.m.breaker_state, self.m.breaker_opens, self.m.redis_slots):
            try:
                metric.remove(shard)
            except KeyError:  # never had that series
                pass


def make_store(settings: AgentSettings, m: AgentMetrics) -> RedisNode | ClusterStore:
    """The store ``--redis-url`` names (region_agent.store.client), wired to ``m``."""
    url = redis_url_with_secrets(settings)
    try:
        parsed = parse_store_url(url, cluster=settings.redis_cluster)
    except ValueError as e:
        raise ConfigError(f"--redis-url: {e}") from None
    scripts = sc.Scripts()
    shards = ShardMetrics(m)
    socket_timeout = settings.redis_socket_timeout_ms / 1000

    def node(client: Any, shard: str, lag: LoopLag | None = None,
                also: Callable[[bool], None] | None = None) -> RedisNode:
        breaker = CircuitBreaker(failure_threshold=settings.breaker_failures, open_s=settings.breaker_open_ms / 1000,
                                 half_open_probes=settings.breaker_probes)
        return RedisNode(client, scripts, max_batch=settings.batch_max, max_queue=settings.queue_max,
                            max_inflight=settings.pipelines_in_flight, on_batch=m.batch_sizes.observe,
                            breaker=breaker, log_interval_s=settings.redis_log_interval_ms / 1000,
                            stall_s=settings.decision_budget_ms / 1000, late_s=socket_timeout, lag=lag,
                            name="redis" if shard == DEFAULT_SHARD else f"redis {shard}", shard=shard,
                            **shards.attach(shard, also))

    if parsed.kind == CLUSTER:
        lag = LoopLag()

        def node_client(name: str, max_connections: int = settings.redis_max_connections) -> Any:
            host, port = name.rsplit(":", 1)
            return make_client(parsed.node_url(host.strip("[]"), int(port)), max_connections=max_connections,
                               socket_timeout=socket_timeout)

        def on_topology(slot_map: SlotMap, changed: bool) -> None:
            shards.topology(slot_map)
            if changed:
                m.redis_topology_changes.inc()

        return ClusterStore(parsed.names, lambda name, also: node(node_client(name), name, lag, also),
                            lambda name: node_client(name, 2), scripts, lag=lag,
                            refresh_s=settings.redis_cluster_refresh_ms / 1000,
                            topology_timeout_s=TOPOLOGY_TIMEOUT_S, on_topology=on_topology, on_retire=shards.detach)
    if parsed.kind == SENTINEL:
        password = resolve_secret(settings.redis_sentinel_password_file, "REDIS_SENTINEL_PASSWORD")
        client = make_sentinel_client(parsed, max_connections=settings.redis_max_connections,
                                      socket_timeout=socket_timeout, sentinel_password=password)
        return node(client, DEFAULT_SHARD)
    client = make_client(url, max_connections=settings.redis_max_connections, socket_timeout=socket_timeout)
    return node(client, DEFAULT_SHARD)
