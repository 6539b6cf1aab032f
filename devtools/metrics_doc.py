"""Generate ``docs/metrics.md``: every metric of both services (name, type, labels, meaning and
its series bound) in one table, read from the metric objects the services themselves create.

    python -m devtools.metrics_doc            # (re)write docs/metrics.md
    python -m devtools.metrics_doc --check    # exit 1 if docs/metrics.md is not what the code says

``tests/unit/devtools/test_metrics_doc.py`` runs the check; ``tests/e2e/test_deploy_files.py`` proves every
metric of the table is exported by live processes and that the dashboard and alert rules name
only metrics (and labels) of the table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

# Series bound of each metric (agent: per agent process; allocator: per replica). Symbols:
# R rules in the bundle, T tenant labels (tenants named by rules, at most 50, + other + none),
# P pools, G route groups named by rules (+ all/none), S store shards (1 standalone, cluster primaries),
# N regions that leased (at most 64, then "other"). Histograms count their 11-13 bucket series once.
BOUNDS: dict[str, str] = {
    "leasehold_agent_decisions_total": "7 outcomes x (R+1) rules x 2 versions x T x sources (route group follows "
                                       "the rule; the source is mostly fixed by the outcome: at most 3 per outcome)",
    "leasehold_build_info": "1",
    "leasehold_agent_decision_seconds": "S x 7 outcomes",
    "leasehold_agent_script_errors_total": "error classes of kernel.errors (< 10)",
    "leasehold_agent_degraded_decisions_total": "7 reasons x 4 fail modes (the closed ones exported at 0 from the start)",
    "leasehold_agent_pool_waits_total": "P",
    "leasehold_agent_pool_renewals_total": "P x 7 outcomes",
    "leasehold_agent_chunk_abandoned_tokens_total": "P",
    "leasehold_agent_chunk_refunded_tokens_total": "P",
    "leasehold_agent_hot_chunks_total": "4 outcomes",
    "leasehold_agent_hot_chunk_abandoned_units_total": "1",
    "leasehold_agent_batch_size": "1",
    "leasehold_agent_queue_rejections_total": "1",
    "leasehold_agent_shed_total": "3 stages (queue, queue_full, pool)",
    "leasehold_agent_pool_busy_denials_total": "P",
    "leasehold_agent_policy_reloads_total": "6 outcomes",
    "leasehold_agent_policy_version": "1",
    "leasehold_agent_policy_age_seconds": "1",
    "leasehold_agent_policy_epoch_mismatches_total": "2",
    "leasehold_agent_policy_candidate_version": "1",
    "leasehold_agent_policy_canary_offers_total": "3 outcomes",
    "leasehold_agent_decision_log_lines_total": "2 results",
    "leasehold_agent_shadow_decisions_total": "R x 3 outcomes",
    "leasehold_agent_policy_defects_total": "R + 1",
    "leasehold_agent_negative_cache_hits_total": "1",
    "leasehold_agent_lease_grants_total": "P x 7 outcomes",
    "leasehold_agent_lease_granted_tokens_total": "P",
    "leasehold_agent_pool_depletions_total": "P",
    "leasehold_agent_stranded_tokens_total": "P",
    "leasehold_agent_lease_lost_tokens_total": "P",
    "leasehold_agent_pool_balance_tokens": "P",
    "leasehold_agent_allocator_reachable": "1",
    "leasehold_agent_allocator_seconds": "1 call kind",
    "leasehold_agent_breaker_state": "S (one breaker per primary of the slot map; a standalone or Sentinel store: 1)",
    "leasehold_agent_breaker_opens_total": "S",
    "leasehold_agent_redis_slots": "S (Redis Cluster only)",
    "leasehold_agent_redis_topology_changes_total": "1",
    "leasehold_agent_redis_up": "S",
    "leasehold_agent_pool_admitted_tokens_total": "P x 2 sources",
    "leasehold_agent_bypass_decisions_total": "exempt rules x 7 outcomes",
    "leasehold_agent_audit_events_total": "2",
    "leasehold_agent_audit_write_errors_total": "1",
    "leasehold_agent_redis_memory_used_bytes": "S",
    "leasehold_agent_redis_memory_max_bytes": "S",
    "leasehold_agent_redis_evicted_keys_total": "S",
    "leasehold_agent_redis_expired_keys_total": "S",
    "leasehold_agent_redis_keys": "S",
    "leasehold_agent_redis_connected_clients": "S",
    "leasehold_agent_redis_replicas": "S",
    "leasehold_agent_redis_replica_lag_seconds": "S",
    "leasehold_agent_redis_replica_lag_bytes": "S",
    "leasehold_agent_redis_script_calls_total": "S",
    "leasehold_agent_redis_script_seconds_total": "S",
    "leasehold_agent_redis_info_age_seconds": "S",
    "leasehold_agent_redis_evicting": "S",
    "leasehold_agent_new_keys_total": "6 source classes",
    "leasehold_agent_rls_requests_total": "9 outcomes",
    "leasehold_agent_rls_invalid_total": "invalid-argument reasons of region_agent.gateways (< 16)",
    "leasehold_agent_rls_descriptors_total": "2 codes",
    "leasehold_agent_rls_seconds": "1",
    "leasehold_agent_rls_group_calls": "1",
    "leasehold_agent_rlqs_streams": "1",
    "leasehold_agent_rlqs_max_streams": "1",
    "leasehold_agent_rlqs_streams_fill": "1",
    "leasehold_agent_rlqs_buckets": "1",
    "leasehold_agent_rlqs_reports_total": "1",
    "leasehold_agent_rlqs_usage_total": "2 outcomes",
    "leasehold_agent_rlqs_assignments_total": "6 kinds",
    "leasehold_agent_rlqs_assigned_tokens_total": "1",
    "leasehold_agent_rlqs_stranded_tokens_total": "1",
    "leasehold_agent_rlqs_unauthenticated_total": "1",
    "leasehold_agent_rlqs_refused_streams_total": "2 reasons (not_ready, exhausted)",
    "leasehold_agent_rlqs_rounds_total": "5 outcomes",
    "leasehold_agent_rlqs_refused_total": "refusal reasons of region_agent.gateways (< 15)",
    "leasehold_agent_authz_seconds": "1",
    "leasehold_agent_authz_requests_total": "HTTP statuses answered (< 10)",
    "leasehold_agent_authz_unauthenticated_total": "2 callers (gateway, client)",
    "leasehold_agent_authz_invalid_total": "malformed-question reasons of region_agent.gateways (< 10)",
    "leasehold_allocator_grants_total": "P x N",
    "leasehold_allocator_granted_tokens_total": "P x N",
    "leasehold_allocator_replayed_grants_total": "P",
    "leasehold_allocator_pool_exhaustions_total": "P",
    "leasehold_allocator_empty_grants_total": "P x N",
    "leasehold_allocator_reclaimed_tokens_total": "P x N",
    "leasehold_allocator_stranded_tokens_total": "P x N",
    "leasehold_allocator_unreported_tokens_total": "P x N",
    "leasehold_allocator_txn_conflicts_total": "2 kinds",
    "leasehold_allocator_txn_retries_total": "2 kinds",
    "leasehold_allocator_grants_per_txn": "1",
    "leasehold_allocator_leader_changes_total": "1",
    "leasehold_allocator_is_leader": "1",
    "leasehold_allocator_shards_led": "1",
    "leasehold_allocator_shards": "1",
    "leasehold_allocator_shard_changes_total": "2 directions (acquired, released)",
    "leasehold_allocator_etcd_compactions_total": "1",
    "leasehold_allocator_etcd_compacted_revision": "1",
    "leasehold_allocator_etcd_refused": "4 causes (exported at 0 from the start)",
    "leasehold_agent_etcd_refused": "4 causes (exported at 0 from the start)",
    "leasehold_allocator_epoch": "1",
    "leasehold_allocator_fenced_total": "1",
    "leasehold_allocator_pool_limit_tokens": "P",
    "leasehold_allocator_pool_window_seconds": "P",
    "leasehold_allocator_pool_fallback_per_region_tokens": "P",
    "leasehold_allocator_policy_reloads_total": "6 outcomes",
    "leasehold_allocator_policy_version": "1",
    "leasehold_allocator_policy_age_seconds": "1",
    "leasehold_allocator_pool_window_granted_ratio": "P",
    "leasehold_allocator_etcd_request_seconds": "etcd operation names (< 10)",
    "leasehold_agent_http_connections": "1",
    "leasehold_agent_http_max_connections": "1",
    "leasehold_agent_http_refused_connections_total": "1",
    "leasehold_agent_rls_connections": "1",
    "leasehold_agent_rls_max_connections": "1",
    "leasehold_allocator_http_connections": "1",
    "leasehold_allocator_http_max_connections": "1",
    "leasehold_allocator_http_refused_connections_total": "1",
}


@dataclass(frozen=True)
class MetricRow:
    service: str
    name: str  # as exposed (counters with _total; histograms by their base name)
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def bound(self) -> str:
        return BOUNDS.get(self.name, "")


def _exposed(name: str, kind: str) -> str:
    return name + "_total" if kind == "counter" and not name.endswith("_total") else name


def rows_of(service: str, metrics_obj: object) -> list[MetricRow]:
    out: dict[str, MetricRow] = {}
    for value in vars(metrics_obj).values():
        if isinstance(value, MetricWrapperBase):
            kind = value._type
            name = _exposed(value._name, kind)
            out[name] = MetricRow(service, name, kind, tuple(value._labelnames), value._documentation)
        elif hasattr(value, "describe") and hasattr(value, "collect"):
            labels = tuple(value.LABELS)  # a custom collector states its label names
            for fam in value.describe():
                name = _exposed(fam.name, fam.type)
                out[name] = MetricRow(service, name, fam.type, labels, fam.documentation)
    return sorted(out.values(), key=lambda r: r.name)


def all_rows() -> list[MetricRow]:
    from prometheus_client import CollectorRegistry

    from allocator.metrics import AllocatorMetrics
    from region_agent.gateways.metrics import GatewayMetrics
    from region_agent.service.metrics import AgentMetrics

    agent = rows_of("agent", AgentMetrics()) + rows_of("agent", GatewayMetrics(CollectorRegistry()))
    return sorted(agent, key=lambda r: r.name) + rows_of("allocator", AllocatorMetrics())


HEADER = """# Metrics

Generated from the code by `python -m devtools.metrics_doc` (do not edit by hand;
`tests/unit/devtools/test_metrics_doc.py` fails when this file and the code disagree). Every metric below is
exported by a live agent or allocator (`tests/e2e/test_deploy_files.py` scrapes real processes), and
the Grafana dashboard and the Prometheus alert rules (`deploy/`) use only these names and labels.

## Cardinality budget

Labels carry only values from bounded sets: outcome codes, rule ids, route groups and pool ids of
the bundle, tenants **named in the bundle** (at most 50; every other tenant is `other`, anonymous
requests `none`), store shards, regions (at most 64, then `other`) and at most two policy versions
(the series of older versions are removed when a third appears). Never a principal, API key, IP
address, Redis key, lease id or request id (those go to logs: the audit trail carries the request
id, never the principal).

Neither service exports `*_created` series (`prometheus_client.disable_created_metrics()`): they
would double every counter's and histogram's series and nothing uses them.

Symbols in the *series bound* column: R rules in the bundle, T tenant labels (named tenants + 2),
P pools, S store shards (1 for a standalone Redis), N regions (at most 64). Per agent process the
total is dominated by `leasehold_agent_decisions_total` (14 x (R+1) x T combinations of outcome,
policy version, rule and tenant, each once per layer that decided it: the `source`, one for most
combinations, at most 3) and the decision latency histogram (S x 7 x 13 bucket series). For
`policies/northstar-global.json` (R = 7, T = 5: atlas, birch, northstar-ops, other, none; P = 3,
S = 1): decisions 560 combinations (at most 1,680 series), latency 91, everything else (the gateway
front doors included) under 300: **under 2,100 series per agent**, and under 300 per allocator
replica with two regions. (Measured on a signed `leasehold up` after demo traffic: about 150 on an
agent, about 100 on the allocator.) A bundle that names more tenants gets at most 50 tenant labels
(the first 50 in sorted order; the rest count as `other`).

Besides the table, both services export the standard collectors of `prometheus_client`:
`process_*` (resident and virtual memory, CPU seconds, open and maximum file descriptors, start
time), `python_info` and `python_gc_*`. An agent with `--workers N` exports one consistent set of
series: every worker's counters, histograms and gauges summed (gauges: the highest breaker state
and pool balance, the lowest allocator reachability and policy version of the live workers), the
`process_*` values of all workers together; `python_gc_*` is not exported then. With several
workers, the series of a policy version older than the last two stay until the agent restarts.
The `region` of an agent's series is a target label of the scrape configuration
(`deploy/prometheus/prometheus.yml`), like `instance` and `job`.

The connection caps ([decision 0075](decisions/0075-a-port-at-its-connection-cap-shows-in-the-metrics.md)):
an HTTP port's open connections (`*_http_connections`) against its cap (`*_http_max_connections`)
say how near it is to refusing, and `*_http_refused_connections_total` counts the connections it
answered 503 `too-many-connections`. The agent's gRPC port has **no refused count**: grpc closes a
connection past `--rls-max-connections` without telling the process. What is measured is how many
connections the port holds (`leasehold_agent_rls_connections`, read from the kernel's socket tables
at each scrape) against its cap (`leasehold_agent_rls_max_connections`): at the cap every new
connection is refused. With several workers the open connections and the caps are the fullest
worker's (each worker has its own caps) and the refused counts are summed.

The RLQS door's streams (`leasehold_agent_rlqs_streams`) compare with its cap
(`leasehold_agent_rlqs_max_streams`, `--rlqs-max-streams`); with several workers both are summed
over them, and `leasehold_agent_rlqs_streams_fill` is the fullest worker's open streams over its
cap, which is what its alert reads (each worker refuses at its own cap;
[decision 0092](decisions/0092-an-rlqs-stream-refused-at-the-cap-pages.md)).

## Table

| metric | service | type | labels | meaning | series bound |
|---|---|---|---|---|---|
"""


def render(rows: list[MetricRow]) -> str:
    lines = [HEADER.rstrip("\n")]
    for r in rows:
        labels = ", ".join(f"`{x}`" for x in r.labels) or "-"
        meaning = r.help.replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.service} | {r.type} | {labels} | {meaning} | {r.bound or '?'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.metrics_doc",
                                 description=f"write {DOC.name} from the code (the default), or check it")
    ap.add_argument("--check", action="store_true", help="exit 1 when the file and the code disagree; write nothing")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)  # a typo (--chek) is exit 2, not a write
    text = render(all_rows())
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is out of date: run python -m devtools.metrics_doc", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(all_rows())} metrics)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
