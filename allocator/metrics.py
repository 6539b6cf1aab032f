"""Prometheus metrics of the allocator. Labels are bounded values only (pool, region from the
policy bundle; etcd operation names; outcome codes), never lease ids."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kernel.build_info import BuildInfo
from kernel.bundle import Pool
from kernel.connection_metrics import ConnectionMetrics
from kernel.etcd_store import EtcdRefused, EtcdStore
from kernel.metrics_exposition import standard_collectors
from kernel.policy_metrics import policy_metrics

if TYPE_CHECKING:
    from .election import Election

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # type: ignore[no-untyped-call]  # (unannotated in prometheus_client) no *_created series (docs/metrics.md, cardinality budget)
MAX_REGION_LABELS = 64


class WindowFill:
    """``leasehold_allocator_pool_window_granted_ratio{pool}``: tokens granted (net of returns) in
    the pool's *current* window as a fraction of its limit G, as this replica's last grant
    decision saw it (0 once that window has ended without a newer decision). The "grants near G"
    signal; one series per pool."""

    NAME = "leasehold_allocator_pool_window_granted_ratio"
    HELP = "Granted (net of returns) / G in the pool's current window, from the last grant decision"
    LABELS = ("pool",)

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._seen: dict[tuple[str, int], tuple[int, int, float]] = {}  # (pool, k) -> (start, end, ratio)

    def note(self, pool: str, index: int, start_ms: int, end_ms: int, limit: int, remaining: int) -> None:
        self._seen[(pool, index)] = (start_ms, end_ms, (limit - remaining) / limit if limit > 0 else 0.0)
        if len(self._seen) > 4 * 1024:  # windows of pools no longer granted from
            now = self.clock() * 1000
            for k in [k for k, (_, end, _) in self._seen.items() if end <= now]:
                del self._seen[k]

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        now = self.clock() * 1000
        ratio: dict[str, float] = {}
        for (pool, _), (start, end, r) in list(self._seen.items()):
            ratio.setdefault(pool, 0.0)
            if start <= now < end:
                ratio[pool] = r
        for pool, r in sorted(ratio.items()):
            fam.add_metric([pool], r)
        yield fam


class AllocatorMetrics:
    """One registry per app instance, so several in-process apps do not collide."""

    def __init__(self) -> None:
        self._regions: set[str] = set()
        self._granted: dict[tuple[str, str], list[int]] = {}  # (pool, region) -> [grants, tokens] not yet counted
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.grants = Counter("leasehold_allocator_grants_total", "Lease grants committed (new, not replays)",
                              ["pool", "region"], registry=r)
        self.granted_tokens = Counter("leasehold_allocator_granted_tokens_total", "Tokens granted",
                                      ["pool", "region"], registry=r)
        self.replays = Counter("leasehold_allocator_replayed_grants_total",
                               "Lease requests answered from a stored grant (retries)", ["pool"], registry=r)
        self.exhaustions = Counter("leasehold_allocator_pool_exhaustions_total",
                                   "Windows whose remaining reached 0 through a grant", ["pool"], registry=r)
        self.empty_grants = Counter("leasehold_allocator_empty_grants_total",
                                    "Requests answered with granted=0 (pool exhausted)", ["pool", "region"],
                                    registry=r)
        self.reclaimed_tokens = Counter("leasehold_allocator_reclaimed_tokens_total",
                                        "Unspent tokens returned to an open window by usage reports",
                                        ["pool", "region"], registry=r)
        self.stranded_tokens = Counter("leasehold_allocator_stranded_tokens_total",
                                       "Unspent tokens reported after their window closed", ["pool", "region"],
                                       registry=r)
        self.unreported_tokens = Counter(
            "leasehold_allocator_unreported_tokens_total",
            "Tokens of expired leases never reported by the time the leader retired their window "
            "(spent or stranded: unknown)", ["pool", "region"], registry=r)
        self.txn_conflicts = Counter("leasehold_allocator_txn_conflicts_total",
                                     "Leader transactions that failed a compare", ["kind"], registry=r)
        self.txn_retries = Counter("leasehold_allocator_txn_retries_total",
                                   "Transaction attempts retried after a conflict", ["kind"], registry=r)
        self.txn_grants = Histogram("leasehold_allocator_grants_per_txn", "Grants carried by one transaction",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.leader_changes = Counter("leasehold_allocator_leader_changes_total",
                                      "Leadership changes observed by this replica", registry=r)
        self.is_leader = Gauge("leasehold_allocator_is_leader", "1 while this replica leads", registry=r)
        self.epoch = Gauge("leasehold_allocator_epoch", "Epoch of the leader this replica knows (0 = none)",
                           registry=r)
        self.shards_led = Gauge("leasehold_allocator_shards_led",
                                "Shards of leadership this replica leads and accepts writes for", registry=r)
        self.shards = Gauge("leasehold_allocator_shards",
                            "Shards of leadership the pools are spread over (--shards; 1: unsharded)", registry=r)
        self.shard_changes = Counter("leasehold_allocator_shard_changes_total",
                                     "Shards this replica started (acquired) or stopped (released) leading",
                                     ["event"], registry=r)
        self.fenced = Counter("leasehold_allocator_fenced_total", "Writes refused by the epoch compare",
                              registry=r)
        self.pool_limit = Gauge("leasehold_allocator_pool_limit_tokens", "G: a pool's tokens per window",
                                ["pool"], registry=r)
        self.pool_window_ms = Gauge("leasehold_allocator_pool_window_seconds", "A pool's window length",
                                    ["pool"], registry=r)
        self.pool_fallback = Gauge("leasehold_allocator_pool_fallback_per_region_tokens",
                                   "A pool's fallback allowance per region and window (the overshoot term)",
                                   ["pool"], registry=r)
        self.etcd_refused = Gauge("leasehold_allocator_etcd_refused",
                                  "1 while etcd refuses this replica's last read or write for this cause "
                                  "(auth, permission, nospace, tls)", ["cause"], registry=r)
        self.compactions = Counter("leasehold_allocator_etcd_compactions_total",
                                   "etcd history compactions done by this replica", registry=r)
        self.compacted_revision = Gauge("leasehold_allocator_etcd_compacted_revision",
                                        "The revision this replica last compacted etcd's history to", registry=r)
        self.policy_reloads, self.bundle_version, self.policy_age = policy_metrics(
            "allocator", r, offered="from etcd", age="Seconds since the policy key was last read from etcd")
        self.window_fill = WindowFill()
        r.register(self.window_fill)
        self.build_info = BuildInfo()
        r.register(self.build_info)
        # the HTTP port's connections against its cap (kernel.connection_metrics): read at collection
        self.connections = ConnectionMetrics("allocator")
        r.register(self.connections)
        standard_collectors(r)  # process (memory, CPU, open fds), platform, GC
        self.etcd_latency = Histogram("leasehold_allocator_etcd_request_seconds", "etcd request latency",
                                      ["op"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                       1, 2.5), registry=r)

    def describe_pools(self, pools: Iterable[Pool]) -> None:
        for p in pools:
            self.pool_limit.labels(p.id).set(p.limit)
            self.pool_window_ms.labels(p.id).set(p.window_ms / 1000)
            self.pool_fallback.labels(p.id).set(p.fallback_per_region)

    def region(self, region: str) -> str:
        """Region label value; at most ``MAX_REGION_LABELS`` distinct ones (then ``other``),
        so a caller inventing region names cannot grow the label set without bound."""
        if region in self._regions:
            return region
        if len(self._regions) < MAX_REGION_LABELS:
            self._regions.add(region)
            return region
        return "other"

    def observe_etcd(self, op: str, seconds: float) -> None:
        self.etcd_latency.labels(op).observe(seconds)

    def follow_election(self, election: Election) -> None:
        """The leadership gauges read the election at scrape time."""
        self.is_leader.set_function(lambda: 1.0 if election.is_leader else 0.0)
        self.shards_led.set_function(lambda: float(len(election.led)))
        self.shards.set(election.shards)
        self.epoch.set_function(lambda: float(election.leader.epoch or 0))

    def follow_store(self, store: EtcdStore) -> None:
        """``leasehold_allocator_etcd_refused{cause}`` reads the store's refusals in force at scrape
        time; every cause is exported (0) from the start, so an alert needs no series to appear."""
        def refusing(cause: str) -> Callable[[], float]:
            return lambda: 1.0 if any(e.cause == cause for e in store.refused.values()) else 0.0

        for cause in EtcdRefused.CAUSES:
            self.etcd_refused.labels(cause).set_function(refusing(cause))

    def on_leadership(self, event: str, shard: int, epoch: int | None) -> None:
        """The election's events: this replica ``acquired`` or ``released`` a shard, or shard 0's
        leader changed (``observed``: a leader change, whoever leads now)."""
        if event == "observed":
            self.leader_changes.inc()
        else:
            self.shard_changes.labels(event).inc()

    def count_grant(self, pool: str, region: str, granted: int, exhausted_now: bool) -> None:
        """A committed grant. Granted ones are tallied per (pool, region) and moved into the
        counters at scrape time (one labelled increment per pair and scrape instead of two per grant)."""
        if granted:
            counts = self._granted.get((pool, region))
            if counts is None:
                if len(self._granted) >= 100_000:
                    self._flush_grants()
                counts = self._granted[(pool, region)] = [0, 0]
            counts[0] += 1
            counts[1] += granted
        else:
            self.empty_grants.labels(pool, self.region(region)).inc()
        if exhausted_now:
            self.exhaustions.labels(pool).inc()

    def _flush_grants(self) -> None:
        counts, self._granted = self._granted, {}
        for (pool, region), (grants, tokens) in counts.items():
            label = self.region(region)
            self.grants.labels(pool, label).inc(grants)
            self.granted_tokens.labels(pool, label).inc(tokens)

    def render(self) -> bytes:
        self._flush_grants()
        return generate_latest(self.registry)
