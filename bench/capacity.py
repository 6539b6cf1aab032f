"""Capacity arithmetic of a sharded allocator deployment (pure: numbers in, numbers out).

Used by the "shards" figure (``fig_shards.py``) for its projected capacity and by ``docs/capacity.md``
for the plan; ``python -m bench.capacity [results.json]`` prints the plan's table
from a benchmark run's measurements.

Units: CPU costs in microseconds of one core per lease (a grant, or a grant plus its usage
report); rates per second; TTLs in milliseconds.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Projection:
    per_s: float  # leases per second the deployment can grant
    replica_bound: float  # replicas x cores / CPU per lease of a replica
    etcd_bound: float  # etcd cores / etcd CPU per lease (or a measured/published ceiling)
    bound_by: str  # "replicas" or "etcd"


def projected_capacity(replicas: int, replica_us: float, etcd_us: float, *, replica_cores: float = 1.0,
                       etcd_cores: float = 1.0, etcd_ceiling: float | None = None) -> Projection:
    """``min(replicas x replica_cores x 1e6 / replica_us, etcd ceiling)``; the etcd ceiling is
    ``etcd_cores x 1e6 / etcd_us`` unless a measured or published ceiling is given."""
    if replicas < 1 or replica_us <= 0 or etcd_us <= 0:
        raise ValueError("replicas >= 1 and positive CPU costs are needed")
    rep = replicas * replica_cores * 1e6 / replica_us
    etcd = etcd_ceiling if etcd_ceiling is not None else etcd_cores * 1e6 / etcd_us
    return Projection(min(rep, etcd), rep, etcd, "replicas" if rep <= etcd else "etcd")


def leases_per_ttl(demand_per_s: float, lease_ttl_ms: int, chunk_max: int) -> int:
    """Leases one active (pool, region) takes per lease TTL: one, or more when its demand over a
    TTL exceeds the largest chunk (``ceil(demand x TTL / chunkMax)``)."""
    if chunk_max < 1 or lease_ttl_ms < 1:
        raise ValueError("chunk_max and lease_ttl_ms must be positive")
    return max(1, math.ceil(demand_per_s * lease_ttl_ms / 1000 / chunk_max))


def leases_per_s(active_pool_regions: int, lease_ttl_ms: int, per_ttl: int = 1) -> float:
    """Lease grants per second a deployment makes (each active pool-region renews every TTL)."""
    return active_pool_regions * per_ttl * 1000 / lease_ttl_ms


def pool_regions_served(capacity_per_s: float, lease_ttl_ms: int, per_ttl: int = 1) -> int:
    """Active (pool, region) pairs a capacity of ``capacity_per_s`` leases/s serves."""
    return int(capacity_per_s * lease_ttl_ms / 1000 / per_ttl)


def replicas_needed(leases_s: float, replica_us: float, replica_cores: float = 1.0, utilisation: float = 0.7) -> int:
    """Replicas (one process, ``replica_cores`` each) to carry ``leases_s`` at ``utilisation``."""
    return max(1, math.ceil(leases_s * replica_us / 1e6 / replica_cores / utilisation))


def plan_rows(replica_us: float, etcd_us: float, etcd_ceiling: float, *, regions: int = 5,
              ttls_ms: tuple[int, ...] = (5_000, 15_000, 60_000), replicas: tuple[int, ...] = (1, 3, 8)) -> list[dict]:
    """Pools served (one lease per pool-region per TTL) by ``replicas`` replicas, per lease TTL."""
    rows = []
    for n in replicas:
        p = projected_capacity(n, replica_us, etcd_us, etcd_ceiling=etcd_ceiling)
        for ttl in ttls_ms:
            rows.append({"replicas": n, "leases_per_s": round(p.per_s), "bound_by": p.bound_by, "ttl_ms": ttl,
                         "pools": pool_regions_served(p.per_s, ttl) // regions, "regions": regions})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the plan from a bench results.json (the "shards" figure's per-lease costs)."""
    args = argv if argv is not None else sys.argv[1:]
    path = Path(args[0] if args else "bench-results/results.json")
    rows = json.loads(path.read_text())["rows"]
    costs = [r for r in rows if r.get("figure") == "shards" and "lease_cost_us" in r.get("extra", {})]
    # the agents send their reports in batches: that row's cost when the run has one
    cost = next((r for r in costs if r["extra"].get("mode") == "batch"), costs[0] if costs else None)
    if cost is None:
        print(f"{path}: no 'shards' figure lease cost row (run python -m bench --only shards)", file=sys.stderr)
        return 1
    c = cost["extra"]["lease_cost_us"]
    print(f"per lease: replica {c['replica']:.0f} us, etcd {c['etcd']:.0f} us (grant + usage report"
          f"{', reports in batches' if cost['extra'].get('mode') == 'batch' else ''})")
    for r in plan_rows(c["replica"], c["etcd"], 1e6 / c["etcd"]):
        print(f"  {r['replicas']} replica(s): {r['leases_per_s']:>8,} leases/s ({r['bound_by']}-bound); "
              f"TTL {r['ttl_ms'] / 1000:g} s -> {r['pools']:,} pools x {r['regions']} regions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
