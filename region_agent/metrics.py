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
        self.policy_reloads = Counter("leasehold_agent_policy_reloads_total", "Policy reload attempts",
                                      ["outcome"], registry=r)
        self.policy_version = Gauge("leasehold_agent_policy_version", "Bundle version in force", registry=r)
        self.shadow = Counter("leasehold_agent_shadow_decisions_total", "Shadow rule evaluations",
                              ["rule", "outcome"], registry=r)
        self.policy_defects = Counter("leasehold_agent_policy_defects_total",
                                      "429s without Retry-After (retry -1: can never succeed)", ["rule"],
                                      registry=r)
