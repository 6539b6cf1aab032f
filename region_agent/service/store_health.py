"""Store health ("can the store keep enforcement correct?"): a low-frequency INFO
poll of every shard, exported per shard.

One ``INFO memory stats clients replication keyspace commandstats`` per shard per ``--store-health-ms`` (5 s by default; 0 disables), the
shards read concurrently, each bounded by its own timeout (1 s): a shard that does not answer
keeps its last snapshot, its age grows (``leasehold_agent_redis_info_age_seconds``) and
``leasehold_agent_redis_up`` says 0, while the other shards' series stay current. A shard is
``default`` for a standalone Redis (or the primary a Sentinel names) and the primary's
``host:port`` for Redis Cluster (the primaries of the agent's slot map: a primary that left it —
failed over, removed — loses its series at the next poll). Store health is reported here only:
readiness (``/readyz``) does not depend on it.

Exported (label ``shard`` only): memory used vs ``maxmemory``, evicted and expired keys (Redis'
own counters, so they reset when Redis restarts, which Prometheus' ``rate`` handles), key count,
connected clients, connected replicas, replica lag (seconds since the slowest replica's last
ack, and bytes behind the primary's replication offset), and the server-side script time
(``EVALSHA``/``EVAL`` calls and microseconds from ``INFO commandstats``: the mean script duration
is ``rate(seconds) / rate(calls)``), and whether the shard may evict keys
(``leasehold_agent_redis_evicting``: its ``maxmemory-policy`` is not ``noeviction``).

**An evicting store.** An evicted bucket comes back full: eviction silently resets enforcement.
The agent reads every shard's ``maxmemory-policy`` at start and refuses to start on an evicting
store (:func:`check_eviction_policy`) unless ``--allow-evicting-store``, which starts it
degraded with a loud log line per shard and the gauge at 1. Every poll checks again: a policy
changed to an evicting one while running is logged (once per change), shown by the gauge and by
``/readyz`` (not ready, unless allowed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

SHARD_DEFAULT = "default"
POLL_TIMEOUT_S = 1.0  # one round of INFO (the client's socket timeout usually ends it first)
SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro")

# (metric name, type, help, snapshot field); every family has the one label ``shard``
FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("leasehold_agent_redis_memory_used_bytes", "gauge", "Store memory in use (INFO used_memory)", "used_memory"),
    ("leasehold_agent_redis_memory_max_bytes", "gauge", "Store memory limit (INFO maxmemory; 0 = no limit)",
     "maxmemory"),
    ("leasehold_agent_redis_evicted_keys", "counter", "Keys the store evicted (any eviction silently resets "
     "enforcement)", "evicted_keys"),
    ("leasehold_agent_redis_expired_keys", "counter", "Keys the store expired (INFO expired_keys)", "expired_keys"),
    ("leasehold_agent_redis_keys", "gauge", "Keys in the store (the active-key count, INFO keyspace)", "keys"),
    ("leasehold_agent_redis_connected_clients", "gauge", "Client connections to the store", "connected_clients"),
    ("leasehold_agent_redis_replicas", "gauge", "Replicas connected to the shard's primary", "replicas"),
    ("leasehold_agent_redis_replica_lag_seconds", "gauge", "Seconds since the slowest replica's last "
     "acknowledgement (0 without replicas)", "replica_lag_seconds"),
    ("leasehold_agent_redis_replica_lag_bytes", "gauge", "Bytes the slowest replica is behind the primary's "
     "replication offset (0 without replicas)", "replica_lag_bytes"),
    ("leasehold_agent_redis_script_calls", "counter", "Script executions on the store (EVALSHA and EVAL, INFO "
     "commandstats)", "script_calls"),
    ("leasehold_agent_redis_script_seconds", "counter", "Server-side time spent in scripts (INFO commandstats "
     "usec); mean script duration = rate(seconds) / rate(calls)", "script_seconds"),
    ("leasehold_agent_redis_info_age_seconds", "gauge", "Seconds since the shard's INFO was last read "
     "successfully", "age"),
    ("leasehold_agent_redis_evicting", "gauge", "1 when the shard's maxmemory-policy is not noeviction: an "
     "eviction silently resets enforcement (the agent refuses to start on such a store unless "
     "--allow-evicting-store)", "evicting"),
)
NOEVICTION = "noeviction"
UP = ("leasehold_agent_redis_up", "gauge", "1 if the shard's last INFO poll answered within its timeout, else 0 "
      "(store health, per shard; readiness does not depend on it)")


def parse_info(info: dict[str, Any]) -> dict[str, float]:
    """The fields above from one node's parsed ``INFO`` (redis-py's dict)."""

    def num(key: str) -> float:
        try:
            return float(info.get(key, 0) or 0)
        except (TypeError, ValueError):
            return 0.0

    out = {k: num(k) for k in ("used_memory", "maxmemory", "evicted_keys", "expired_keys", "connected_clients")}
    out["keys"] = float(sum(int(v.get("keys", 0)) for k, v in info.items()
                            if str(k).startswith("db") and isinstance(v, dict)))
    replicas = [v for k, v in info.items() if str(k).startswith("slave") and str(k)[5:].isdigit()
                and isinstance(v, dict)]
    out["replicas"] = float(len(replicas))
    master_offset = num("master_repl_offset")
    out["replica_lag_seconds"] = float(max((int(r.get("lag", 0)) for r in replicas), default=0))
    out["replica_lag_bytes"] = float(max((master_offset - int(r.get("offset", 0)) for r in replicas), default=0))
    calls = usec = 0
    for cmd in SCRIPT_COMMANDS:
        stat = info.get(cmd)
        if isinstance(stat, dict):
            calls += int(stat.get("calls", 0))
            usec += int(stat.get("usec", 0))
    out["script_calls"] = float(calls)
    out["script_seconds"] = usec / 1e6
    out["evicting"] = 0.0 if eviction_policy(info) in (NOEVICTION, None) else 1.0
    return out


def eviction_policy(info: dict[str, Any]) -> str | None:
    """The node's ``maxmemory_policy`` (INFO memory), or None when INFO did not say."""
    policy = info.get("maxmemory_policy")
    return str(policy) if policy is not None else None


def evicting(by_shard: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Shard -> its maxmemory-policy, for every shard whose policy can evict limiter keys."""
    return {shard: p for shard, info in by_shard.items()
            if (p := eviction_policy(info)) is not None and p != NOEVICTION}


def eviction_refusal(bad: dict[str, str]) -> str:
    """Why the agent does not start on the evicting shards ``bad`` (shard -> policy)."""
    return ("the regional Redis may evict keys ("
            + ", ".join(f"{shard}: maxmemory-policy {p}" for shard, p in sorted(bad.items()))
            + "); an evicted bucket is a full bucket, so eviction silently resets enforcement. "
            "Set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in "
            "redis.conf), or start degraded with --allow-evicting-store")


class EvictingStore(RuntimeError):
    """The regional store may evict keys (maxmemory-policy other than noeviction) and the agent
    was not told to accept it (``--allow-evicting-store``)."""


async def check_eviction_policy(store: Any, health: StoreHealth, *, allowed: bool,
                                timeout_s: float = 2.0) -> dict[str, str] | None:
    """At start: read every shard's maxmemory-policy. An evicting store is refused
    (:class:`EvictingStore`) unless ``allowed``; then the agent starts degraded: one loud log line
    per shard and ``leasehold_agent_redis_evicting`` 1. A store that cannot be read now is checked
    by the first successful store-health poll (None is returned)."""
    try:
        shards, answered = await read_info(store, timeout_s)
    except Exception as e:  # the topology is not known yet: the poll checks it once it answers
        shards, answered = [], {}
        log.debug("store INFO read failed: %s", type(e).__name__)
    if not answered:
        log.warning("maxmemory-policy not checked at start (the store did not answer): the store-health "
                    "poll checks it")
        return None
    health.update(answered, shards)
    bad = evicting(answered)
    if bad and not allowed:
        raise EvictingStore("refusing to start: " + eviction_refusal(bad))
    for shard, p in sorted(bad.items()):
        log.error("DEGRADED: the regional Redis shard %s has maxmemory-policy %s: an eviction silently "
                  "resets enforcement (started with --allow-evicting-store)", shard, p)
    health.evicting = bad
    return bad


class StoreHealth:
    """The last INFO snapshot per shard, exported as a Prometheus collector."""

    LABELS = ("shard",)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.snapshots: dict[str, dict[str, float]] = {}
        self._read_at: dict[str, float] = {}
        self.up: dict[str, bool] = {}  # every shard of the last poll: did it answer?
        self.polls_failed = 0
        self.evicting: dict[str, str] = {}  # shard -> maxmemory-policy, where it can evict keys

    def update(self, answered: dict[str, dict[str, Any]], shards: Iterable[str]) -> None:
        """One poll over ``shards``: those in ``answered`` (parsed INFO) are replaced, the others
        keep their last snapshot; shards no longer in ``shards`` are dropped."""
        now = self.clock()
        shards = list(shards)
        for shard, info in answered.items():
            self.snapshots[shard] = parse_info(info)
            self._read_at[shard] = now
        for gone in [s for s in self.snapshots if s not in shards]:
            del self.snapshots[gone], self._read_at[gone]
        self.up = {s: s in answered for s in shards}

    def replace(self, by_shard: dict[str, dict[str, Any]]) -> None:
        """Every shard answered (the shards not in ``by_shard`` are dropped)."""
        self.update(by_shard, by_shard)

    def describe(self):
        return [self._family(name, kind, help_) for name, kind, help_, _ in FAMILIES] + [self._family(*UP)]

    @staticmethod
    def _family(name: str, kind: str, help_: str):
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(name, help_, labels=list(StoreHealth.LABELS))

    def collect(self):
        now = self.clock()
        for name, kind, help_, field in FAMILIES:
            fam = self._family(name, kind, help_)
            for shard, snap in self.snapshots.items():
                value = now - self._read_at[shard] if field == "age" else snap[field]
                fam.add_metric([shard], value)
            yield fam
        up = self._family(*UP)
        for shard, answered in self.up.items():
            up.add_metric([shard], 1.0 if answered else 0.0)
        yield up


async def read_info(store: Any, timeout_s: float) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """INFO from every shard of the store (``store.info_readers()``: shard -> coroutine function),
    concurrently, each bounded by ``timeout_s``: (every shard, the ones that answered -> INFO)."""
    readers = store.info_readers()
    shards = list(readers)
    results = await asyncio.gather(*(asyncio.wait_for(readers[s](), timeout_s) for s in shards),
                                   return_exceptions=True)
    answered: dict[str, dict[str, Any]] = {}
    for shard, res in zip(shards, results, strict=True):
        if isinstance(res, BaseException):  # unreachable, ACL-denied or slow: keep the last snapshot
            log.debug("store INFO read of %s failed: %s", shard, type(res).__name__)
        elif isinstance(res, dict):
            answered[shard] = res
    return shards, answered


async def poll_once(store: Any, health: StoreHealth, timeout_s: float) -> bool:
    """One INFO round over the store's shards (``store.info_readers()``: shard -> coroutine
    function), concurrently, each bounded by ``timeout_s``; False when a shard did not answer
    (its last snapshot is kept, its age grows)."""
    try:
        shards, answered = await read_info(store, timeout_s)
    except Exception as e:  # the topology is not known yet
        health.polls_failed += 1
        log.debug("store INFO poll failed: %s", type(e).__name__)
        return False
    health.update(answered, shards)
    # a shard that did not answer keeps its last known policy; the ones that answered are read anew
    bad = {s: p for s, p in health.evicting.items() if s in shards and s not in answered}
    bad.update(evicting(answered))
    for shard, p in sorted(bad.items()):
        if health.evicting.get(shard) != p:  # once per change, not once per poll
            log.error("the regional Redis shard %s now has maxmemory-policy %s: an eviction silently resets "
                      "enforcement; set maxmemory-policy noeviction", shard, p)
    for shard in sorted(set(health.evicting) - set(bad)):
        log.warning("the regional Redis shard %s no longer evicts keys (maxmemory-policy noeviction)", shard)
    health.evicting = bad
    if len(answered) < len(shards):
        health.polls_failed += 1
        return False
    return True


async def run(store: Any, health: StoreHealth, interval_ms: int) -> None:
    """Poll every ``interval_ms`` until cancelled (the first poll right away)."""
    interval = interval_ms / 1000
    while True:
        with contextlib.suppress(Exception):
            await poll_once(store, health, POLL_TIMEOUT_S)
        await asyncio.sleep(interval)
