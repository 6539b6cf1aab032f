"""Which pool balances an agent leases for before it reports ready (cold start: a region's
first requests wait for its first lease instead of being denied).

Pure: from the policy bundle, every (pool, balance key) this region can spend whose key does not
depend on the request — fleet-wide pools (``{g:<pool>}``) and pools whose rules name their tenant
(bundle validation makes every pool one balance per region). Balances of pools the bundle
restricts to other regions are left out.
"""

from __future__ import annotations

from kernel.bundle import Bundle, Pool

from ..decision.keys import KeyBuilder


def warmup_balances(bundle: Bundle, region: str) -> list[tuple[Pool, str]]:
    pools = {p.id: p for p in bundle.pools}
    out: dict[str, tuple[Pool, str]] = {}
    for r in bundle.rules:
        if r.pool_id not in pools or r.shadow:
            continue
        pool = pools[r.pool_id]
        if pool.regions is not None and region not in pool.regions:
            continue
        if r.scope == "global":
            key = KeyBuilder.global_pool_key(pool.id)
        elif r.tenant is not None:
            key = KeyBuilder.tenant_pool_key(r.tenant, pool.id)
        else:
            continue
        out.setdefault(key, (pool, key))
    return list(out.values())
