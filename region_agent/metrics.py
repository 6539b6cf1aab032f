"""Prometheus metrics of the agent (bounded labels only: never keys, tenants' principals or IPs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter("leasehold_agent_decisions_total", "Admission decisions",
                                 ["outcome", "rule", "policy_version", "route_group"], registry=r)
        self.latency = Histogram("leasehold_agent_decision_seconds", "Decision latency", registry=r,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0))
        self.script_errors = Counter("leasehold_agent_script_errors_total", "Store/script errors by class",
                                     ["error"], registry=r)
        self.degradations = Counter("leasehold_agent_degraded_decisions_total",
                                    "Decisions made without the store", ["reason", "fail_mode"], registry=r)
        self.pool_waits = Counter("leasehold_agent_pool_waits_total",
                                  "Requests that waited for an in-flight chunk renewal", ["pool"], registry=r)
        self.pool_renewals = Counter("leasehold_agent_pool_renewals_total", "Global pool chunk renewals",
                                     ["pool", "outcome"], registry=r)
        self.batch_size = Histogram("leasehold_agent_batch_size", "Script calls per coalesced pipeline",
                                    registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.queue_rejections = Counter("leasehold_agent_queue_rejections_total",
                                        "Script calls refused because the coalescing queue was full", registry=r)
        self.shed = Counter("leasehold_agent_shed_total",
                            "Decisions shed (503 OVERLOADED) because this agent was saturated while the store "
                            "answered, by stage (queue: the script call waited past its budget or the queue "
                            "was full; pool: a chunk renewal could not be sent)", ["stage"], registry=r)
        self.pool_busy = Counter("leasehold_agent_pool_busy_denials_total",
                                 "Fleet-wide pool requests denied locally because the chunk renewal in flight "
                                 "outlasted their budget (a 429 with a short hint, never the fallback)", ["pool"],
                                 registry=r)
        self.policy_reloads = Counter("leasehold_agent_policy_reloads_total", "Policy reload attempts",
                                      ["outcome"], registry=r)
        self.policy_version = Gauge("leasehold_agent_policy_version", "Bundle version in force", registry=r)
        self.shadow = Counter("leasehold_agent_shadow_decisions_total", "Shadow rule evaluations",
                              ["rule", "outcome"], registry=r)
        self.policy_defects = Counter("leasehold_agent_policy_defects_total",
                                      "429s without Retry-After (retry -1: can never succeed)", ["rule"],
                                      registry=r)
        self.negative_hits = Counter("leasehold_agent_negative_cache_hits_total",
                                     "Denials answered from the negative cache (no store call)", registry=r)
        # leases (region side)
        self.lease_grants = Counter("leasehold_agent_lease_grants_total", "Lease answers from the allocator",
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
                                   ["pool"], registry=r)
        self.allocator_up = Gauge("leasehold_agent_allocator_reachable", "1 if the last allocator call succeeded",
                                  registry=r)
        self.allocator_latency = Histogram("leasehold_agent_allocator_seconds", "Allocator call latency",
                                           ["call"], registry=r,
                                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 3))
        self.breaker_state = Gauge("leasehold_agent_breaker_state", "Redis circuit breaker (0 closed, 1 half-open, 2 open)",
                                   ["shard"], registry=r)
        self.pool_admitted = Counter("leasehold_agent_pool_admitted_tokens_total",
                                     "Tokens of global pools admitted by this agent, by source (lease | fallback)",
                                     ["pool", "source"], registry=r)
        self.redis_evicted = Gauge("leasehold_agent_redis_evicted_keys", "Keys the store evicted (INFO stats); "
                                   "any eviction silently resets enforcement", registry=r)
        self.redis_memory = Gauge("leasehold_agent_redis_memory_bytes", "Store memory (INFO memory)", ["kind"],
                                  registry=r)
        self.redis_keys = Gauge("leasehold_agent_redis_keys", "Keys in the store (INFO keyspace)", registry=r)
