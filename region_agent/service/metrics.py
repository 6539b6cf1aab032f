"""Prometheus metrics of the agent (bounded labels only: never keys, principals or IPs).

Every metric is listed with its labels and meaning in ``docs/metrics.md``, generated from this
module by ``python -m devtools.metrics_doc``; the cardinality budget is stated there."""

from __future__ import annotations

import os
from bisect import bisect_left

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.platform_collector import PlatformCollector

from kernel.build_info import BuildInfo
from kernel.connection_metrics import ConnectionMetrics
from kernel.etcd_store import EtcdRefused
from kernel.metrics_exposition import (
    Collectors,
    WorkerProcesses,
    forget_dead_workers,
    multiprocess_dir,
    standard_collectors,
)
from kernel.policy_metrics import policy_metrics

from ..decision.keymeter import CLASSES, NewKeyMeter
from .prometheus_internals import add_observations
from .store_health import StoreHealth


class EtcdRefusedGauge:
    """``leasehold_agent_etcd_refused{cause}``: 1 while the agent's policy etcd refuses its reads
    for that cause (:attr:`kernel.etcd_store.EtcdStore.refused`, read at collection), every cause
    exported (0) from the start — the allocator's ``leasehold_allocator_etcd_refused`` for the
    agent (docs/decisions/0065). A collector of its own: several workers each follow etcd, and
    the answering worker's state is exported (as the snapshot age)."""

    LABELS = ("cause",)
    NAME = "leasehold_agent_etcd_refused"
    HELP = ("1 while the policy etcd refuses this agent's reads for this cause (auth, permission, nospace, tls); "
            "0 without --policy-etcd")

    def __init__(self) -> None:
        self._store: object = None

    def follow(self, store: object) -> None:
        self._store = store

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=list(self.LABELS))]

    def collect(self):
        refused = getattr(self._store, "refused", {}) or {}
        fam = GaugeMetricFamily(self.NAME, self.HELP, labels=list(self.LABELS))
        for cause in EtcdRefused.CAUSES:
            fam.add_metric([cause], 1.0 if any(e.cause == cause for e in refused.values()) else 0.0)
        yield fam


# no ``*_created`` series (one per counter and histogram child): they would double the series count
# of the cardinality budget and carry nothing the dashboard or the alerts use
disable_created_metrics()

OUTCOMES = ("allowed", "denied", "fallback_allowed", "fallback_denied", "unavailable", "conflict", "shed")
# the reason label of leasehold_agent_degraded_decisions_total: the store errors'
# (region_agent.decision.degraded.DEGRADE_REASON) and the fleet-wide pools' own
DEGRADE_REASONS = ("STORE_UNREACHABLE", "AMBIGUOUS", "DEADLINE", "POLICY_ERROR", "ALLOCATOR_UNREACHABLE",
                   "POOL_POLICY_ERROR", "POOL_RENEWAL_FAILED")
DECISION_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # leasehold_agent_batch_size


class PendingObservations:
    """Observations of one histogram child (or a histogram without labels) counted in plain Python
    and added to it at the next collection (:meth:`flush`, run by ``AgentMetrics.add_flush``):
    the exposition reads what one ``observe`` per value would have made (a unit test compares
    them). ``bounds``: the histogram's buckets as it was made with them."""

    __slots__ = ("_bounds", "_child", "_counts", "_total")

    def __init__(self, child: Histogram, bounds: tuple[float, ...]):
        self._child = child
        self._bounds = (*(float(b) for b in bounds), float("inf"))  # +Inf last, as prometheus adds it
        self._counts = [0] * len(self._bounds)
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value
        self._total += value

    def flush(self) -> None:
        counts = self._counts
        if any(counts):
            self._counts = [0] * len(counts)
            total, self._total = self._total, 0.0
            add_observations(self._child, total, counts)


class FlushFirst:
    """A collector registered before every metric: a collection (``/metrics``, ``get_sample_value``)
    first moves the counts kept outside the registry into it (``AgentMetrics.add_flush``), so a
    hot path can count in plain Python and the registry still reads exact values."""

    LABELS = ()  # states no metric (devtools.metrics_doc reads collectors' label names)

    def __init__(self) -> None:
        self.fns: list = []

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        for fn in self.fns:
            fn()
        return []


class AgentMetrics:
    """The agent's metrics in ``registry``. With several workers (``PROMETHEUS_MULTIPROC_DIR`` set,
    kernel.metrics_exposition) the counters, histograms and gauges are summed over the workers'
    files at every scrape (:meth:`render`); collectors that read the same thing in every worker
    are rendered by the worker that answers."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.multiprocess = multiprocess_dir()
        self._flush = FlushFirst()
        r.register(self._flush)
        self._local: list = []  # collectors the answering worker renders itself (several workers)
        self.decisions = Counter("leasehold_agent_decisions_total",
                                 "Admission decisions by outcome, deciding rule, policy version, route group, "
                                 "tenant (tenants named in the bundle; others 'other', anonymous 'none') and the "
                                 "layer that decided (source: script, negative_cache, chunk, local_fallback, "
                                 "pool_fallback, fail_open, fail_closed, overload, policy, preauth, approximate)",
                                 ["outcome", "rule", "policy_version", "route_group", "tenant", "source"], registry=r)
        self.latency = Histogram("leasehold_agent_decision_seconds", "Decision latency by store shard and outcome",
                                 ["shard", "outcome"], registry=r, buckets=DECISION_SECONDS_BUCKETS)
        self.script_errors = Counter("leasehold_agent_script_errors_total", "Store/script errors by class",
                                     ["error"], registry=r)
        self.degradations = Counter("leasehold_agent_degraded_decisions_total",
                                    "Decisions made without the store", ["reason", "fail_mode"], registry=r)
        # every reason's fail-closed series at 0 from the start: LeaseholdFailClosedActivation reads
        # increase(), which sees nothing in a series its first burst created between two scrapes
        for reason in DEGRADE_REASONS:
            self.degradations.labels(reason, "closed")
        self.pool_waits = Counter("leasehold_agent_pool_waits_total",
                                  "Requests that waited for an in-flight chunk renewal", ["pool"], registry=r)
        self.pool_renewals = Counter("leasehold_agent_pool_renewals_total", "Global pool chunk renewals",
                                     ["pool", "outcome"], registry=r)
        self.hot_chunks = Counter("leasehold_agent_hot_chunks_total",
                                  "Chunk takes for hot key sets (outcome: taken, partial: what the rules had left, "
                                  "denied: the request's own denial, error)", ["outcome"], registry=r)
        self.hot_chunk_abandoned = Counter("leasehold_agent_hot_chunk_abandoned_units_total",
                                           "Units a hot key set's chunk still held when their part's validity ended "
                                           "(or a fifth part pushed out the oldest): charged in the store, never "
                                           "refunded",
                                           registry=r)
        self.chunk_abandoned = Counter("leasehold_agent_chunk_abandoned_tokens_total",
                                       "Global pool tokens an in-process chunk still held when its validity ended, "
                                       "or that a denied request gave back after their part had ended (debited from "
                                       "the regional balance, never admitted nor refunded: capacity wasted)",
                                       ["pool"], registry=r)
        self.chunk_refunded = Counter("leasehold_agent_chunk_refunded_tokens_total",
                                      "Global pool tokens an in-process chunk part still held shortly before its "
                                      "validity ended, given back to the leases they were bought from (their close "
                                      "reports them unspent)",
                                      ["pool"], registry=r)
        self.batch_size = Histogram("leasehold_agent_batch_size", "Script calls per coalesced pipeline",
                                    registry=r, buckets=BATCH_SIZE_BUCKETS)
        # the pipelines' sizes counted in plain Python and added at collection (one locked observe per
        # pipeline was a few us of every pipeline): the store nodes' on_batch
        self.batch_sizes = PendingObservations(self.batch_size, BATCH_SIZE_BUCKETS)
        self.add_flush(self.batch_sizes.flush)
        self.queue_rejections = Counter("leasehold_agent_queue_rejections_total",
                                        "Script calls refused because the coalescing queue was full", registry=r)
        self.shed = Counter("leasehold_agent_shed_total",
                            "Decisions shed (503 OVERLOADED) because this agent was saturated while the store "
                            "answered, by stage (queue: the script call waited past its budget or the queue "
                            "was full; pool: a chunk renewal could not be sent)", ["stage"], registry=r)
        for stage in ("queue", "queue_full", "pool"):
            self.shed.labels(stage)
        self.pool_busy = Counter("leasehold_agent_pool_busy_denials_total",
                                 "Fleet-wide pool requests denied locally because the chunk renewal in flight "
                                 "outlasted their budget, or the three renewals they waited for were spent by "
                                 "requests before them (a 429 with a short hint, never the fallback)", ["pool"],
                                 registry=r)
        self.policy_reloads, self.bundle_version, self.policy_age = policy_metrics(
            "agent", r, offered="file reload or etcd",
            age="Snapshot age: seconds since the bundle source (etcd key, else the bundle file) was last read "
                "successfully")
        self.version_mismatches = Counter("leasehold_agent_policy_epoch_mismatches_total",
                                    "Requests whose policyEpoch differs from the bundle version in force "
                                    "(gateway_ahead triggers an immediate policy refresh)", ["relation"], registry=r)
        for relation in ("gateway_ahead", "gateway_behind"):
            self.version_mismatches.labels(relation)
        # staged release (docs/policy.md): the candidate bundle held for this agent's slice, 0 when none
        self.policy_candidate = Gauge("leasehold_agent_policy_candidate_version",
                                      "Canary bundle version held for this agent's slice (0: none)", registry=r,
                                      multiprocess_mode="livemax")
        self.policy_canary = Counter("leasehold_agent_policy_canary_offers_total",
                                     "Canary bundles offered from etcd, by outcome (accepted, kept: the held one "
                                     "stays because the offer would lower a version a slice evaluates, refused)",
                                     ["outcome"], registry=r)
        for outcome in ("accepted", "kept", "refused"):
            self.policy_canary.labels(outcome)
        # the sampled decision log (region_agent/service/decision_log.py; off by default)
        self.decision_log_lines = Counter("leasehold_agent_decision_log_lines_total",
                                          "Sampled decisions for the decision log, by result (written; dropped: over "
                                          "the bytes-per-second bound or a write error)", ["result"], registry=r)
        for result in ("written", "dropped"):
            self.decision_log_lines.labels(result)
        self.shadow = Counter("leasehold_agent_shadow_decisions_total", "Shadow rule evaluations",
                              ["rule", "outcome"], registry=r)
        self.policy_defects = Counter("leasehold_agent_policy_defects_total",
                                      "429s without Retry-After (retry -1: can never succeed)", ["rule"],
                                      registry=r)
        self.negative_hits = Counter("leasehold_agent_negative_cache_hits_total",
                                     "Denials answered from the negative cache (no store call)", registry=r)
        # leases (region side)
        self.lease_grants = Counter("leasehold_agent_lease_grants_total", "Lease answers from the allocator "
                                    "(granted, exhausted, unreachable, refused, stale_epoch, undeposited: the regional "
                                    "balance was full, the grant was returned at once; early: a prefetch of the next "
                                    "window asked before its prefetch time opened on the allocator's clock, asked "
                                    "again by the next tick)",
                                    ["pool", "outcome"], registry=r)
        self.lease_tokens = Counter("leasehold_agent_lease_granted_tokens_total", "Tokens granted to this region",
                                    ["pool"], registry=r)
        self.lease_depletions = Counter("leasehold_agent_pool_depletions_total",
                                        "Allocator answered 'pool exhausted' for the window", ["pool"], registry=r)
        self.lease_stranded = Counter("leasehold_agent_stranded_tokens_total",
                                      "Leased tokens that expired unspent", ["pool"], registry=r)
        self.lease_lost = Counter("leasehold_agent_lease_lost_tokens_total",
                                  "Leased tokens whose Redis record was lost (restart without persistence) or "
                                  "restored from an older state (restart from RDB/AOF, failover): reported to "
                                  "the allocator as spent, never re-deposited or returned; at most this many "
                                  "were really unspent", ["pool"], registry=r)
        self.lease_balance = Gauge("leasehold_agent_pool_balance_tokens", "Spendable leased tokens in Redis",
                                   ["pool"], registry=r, multiprocess_mode="livemax")
        self.allocator_up = Gauge("leasehold_agent_allocator_reachable", "0 if the last allocator call failed (1 before the first)",
                                  registry=r, multiprocess_mode="livemin")
        self.allocator_latency = Histogram("leasehold_agent_allocator_seconds", "Allocator call latency",
                                           ["call"], registry=r,
                                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 3))
        self.breaker_state = Gauge("leasehold_agent_breaker_state", "Redis circuit breaker (0 closed, 1 half-open, 2 open)",
                                   ["shard"], registry=r, multiprocess_mode="livemax")
        self.breaker_opens = Counter("leasehold_agent_breaker_opens_total",
                                     "Store outages: times a shard's circuit breaker opened after being closed (failed "
                                     "half-open probes in between do not count again)", ["shard"], registry=r)
        self.redis_slots = Gauge("leasehold_agent_redis_slots", "Hash slots each Redis Cluster primary owns in this "
                                 "agent's slot map (Redis Cluster only)", ["shard"], registry=r,
                                 multiprocess_mode="livemax")
        self.redis_topology_changes = Counter("leasehold_agent_redis_topology_changes_total",
                                              "Redis Cluster slot-map reads that changed the map (failover, "
                                              "resharding, a primary added or removed)", registry=r)
        self.pool_admitted = Counter("leasehold_agent_pool_admitted_tokens_total",
                                     "Tokens of global pools admitted by this agent, by source (lease | fallback)",
                                     ["pool", "source"], registry=r)
        # privileged bypasses (exempt rules, I14): region_agent.service.audit
        self.bypass_decisions = Counter("leasehold_agent_bypass_decisions_total",
                                        "Decisions made under an exempt rule (a capped, owned bypass), by outcome",
                                        ["rule", "outcome"], registry=r)
        self.audit_events = Counter("leasehold_agent_audit_events_total",
                                    "Audit events written (bypass: one per allowed bypass decision; "
                                    "bypass_denied: at most one per rule per second, with a suppressed count)",
                                    ["event"], registry=r)
        self.audit_errors = Counter("leasehold_agent_audit_write_errors_total",
                                    "Audit events that could not be written", registry=r)
        # store health (INFO per shard) and key growth: collectors filled off the hot path
        self.store_health = StoreHealth()
        r.register(self.store_health)
        self.new_keys = NewKeyMeter()
        r.register(self.new_keys)
        self.build_info = BuildInfo()
        r.register(self.build_info)
        self.etcd_refused = EtcdRefusedGauge()
        r.register(self.etcd_refused)
        # the ports' connections against their caps (kernel.connection_metrics): read at collection
        self.connections = ConnectionMetrics("agent", grpc=True, workers=True)
        r.register(self.connections)
        self._local += [self.store_health, self.policy_age, self.etcd_refused, self.build_info]
        if self.multiprocess:
            # python_info is the same in every worker: the answering one's
            self._local += [WorkerProcesses(self.multiprocess), PlatformCollector(registry=None)]
            self._mirror_new_keys()
            self.add_flush(self.connections.mirror())  # each worker's into the shared files
        else:
            standard_collectors(r)

    def _mirror_new_keys(self) -> None:
        """Several workers: each worker's new-key counts go to a file-backed counter at every
        flush (the meter itself stays a plain per-process collector on the hot path)."""
        mirror = Counter(NewKeyMeter.NAME, NewKeyMeter.HELP, list(NewKeyMeter.LABELS), registry=None)
        sent = dict.fromkeys(CLASSES, 0)
        children = {cls: mirror.labels(cls) for cls in CLASSES}

        def push() -> None:
            for cls, n in self.new_keys.counts.items():
                if n != sent[cls]:
                    children[cls].inc(n - sent[cls])
                    sent[cls] = n

        self.add_flush(push)

    def render(self) -> bytes:
        """The exposition a scrape gets (``/metrics``): this process's registry, or with several
        workers every worker's metrics summed plus this worker's local collectors."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        self.flush()
        forget_dead_workers(self.multiprocess)  # a killed worker's gauges (kernel.metrics_exposition)
        return generate_latest(Collectors([MultiProcessCollector(None, self.multiprocess), *self._local]))

    def close(self) -> None:
        """At a worker's exit: its live-mode gauges no longer count (several workers)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), self.multiprocess)

    def add_flush(self, fn) -> None:
        """Run ``fn`` at the start of every collection (it moves counts kept outside into metrics)."""
        self._flush.fns.append(fn)

    def flush(self) -> None:
        self._flush.collect()
