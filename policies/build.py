"""Build the sample policy bundles and write them sealed (checksum filled in).

    .venv/bin/python policies/build.py            # writes policies/*.json

The Northstar bundle reproduces the worked figures: P-READ (read-user-v3), P-TENANT
(tenant-atlas-minute), P-EXPORT (export-tenant), P-ANON (anon-login) and tenant Birch, plus a
coarse per-address window every request spends first (edge-ip)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernel.bundle import (  # noqa: E402
    Bundle,
    Fallback,
    Pool,
    encode_bundle,
    make_rule,
    seal,
    validate_bundle,
)

HERE = Path(__file__).resolve().parent


def northstar(version: int = 42, published_at: str = "2026-11-06T09:30:00Z") -> Bundle:
    rules = [
        # P-READ: 20 tokens, 2 per second per user on the read group; local fallback 5 and 0.25/s
        make_rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket",
             capacity_millis=20_000, refill_millis=2_000, period_ms=1_000, cost_millis=1_000,
             fail_mode="local_bounded", fallback=Fallback(capacity_millis=5_000, refill_millis=250, period_ms=1_000)),
        # P-TENANT: Atlas may spend 1,000 per minute on every route group
        make_rule(id="tenant-atlas-minute", scope="tenant", tenant="atlas", algorithm="token_bucket",
             capacity_millis=1_000_000, refill_millis=1_000_000, period_ms=60_000, cost_millis=1_000,
             fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=50_000, refill_millis=1_000_000, period_ms=60_000),
             ttl_slack_ms=5_000),
        # P-EXPORT: weighted cost 10, at most 3 in flight per tenant, fail closed, idempotent
        make_rule(id="export-tenant", scope="tenant", route_group="export", algorithm="token_bucket",
             capacity_millis=1_000_000, refill_millis=1_000_000, period_ms=60_000, cost_millis=10_000,
             concurrency_max=3, concurrency_ttl_ms=60_000, concurrency_retry_after_ms=5_000,
             fail_mode="closed", idempotent=True, decision_ttl_ms=30_000, closed_retry_after_ms=5_000),
        # P-ANON: 20 requests per 10 s per client address on /login; local fixed window 5 per 10 s
        make_rule(id="anon-login", scope="ip", route_group="login", algorithm="fixed_window", limit=20,
             window_ms=10_000, fail_mode="local_bounded", fallback=Fallback(limit=5, window_ms=10_000)),
        # The pre-authentication stage of EVERY request (authenticated or not, every route): a
        # coarse window per client address, spent before the tenant's rules; failed
        # authentications are counted here, never against the tenant they claim
        make_rule(id="edge-ip", scope="ip", algorithm="fixed_window", limit=1_000, window_ms=10_000,
             every_request=True, fail_mode="local_bounded", fallback=Fallback(limit=500, window_ms=10_000)),
        # Birch: a smaller tenant, 300 per minute on every route group
        make_rule(id="tenant-birch-minute", scope="tenant", tenant="birch", algorithm="token_bucket",
             capacity_millis=300_000, refill_millis=300_000, period_ms=60_000, cost_millis=1_000,
             fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=20_000, refill_millis=300_000, period_ms=60_000)),
    ]
    return seal(Bundle(bundle_version=version, published_at=published_at, checksum="", rules=rules))


def northstar_global(version: int = 42, published_at: str = "2026-11-06T09:30:00Z") -> Bundle:
    """The multi-region Northstar: P-TENANT becomes a worldwide pool across regions (G = 1,000
    per minute for Atlas, 300 for Birch) granted to regions as leases by the allocator, and the
    fleet-wide P-GLOBAL (40,000 per second on the read group) is spent from in-process chunks.
    Used by ``make run``, the lease tests and the chaos suite.

    Overshoot bound per window (docs/invariants.md I8), with clamped leases:
    Atlas admitted <= 1,000 + 2 regions x 100 fallback = 1,200; Birch <= 300 + 2 x 30 = 360.

    The operators' probe route (tenant northstar-ops, route group probe) is an exempt rule: a
    capped, owned, audited bypass (docs/invariants.md I14)."""
    base = northstar(version, published_at)
    keep = [r for r in base.rules if r.id not in ("tenant-atlas-minute", "tenant-birch-minute")]
    pools = [
        Pool(id="atlas-minute", window_ms=60_000, limit=1_000, lease_ttl_ms=15_000, chunk_min=10, chunk_max=100,
             fallback_per_region=100, prefetch_ms=2_000, active_horizon_ms=10_000),
        Pool(id="birch-minute", window_ms=60_000, limit=300, lease_ttl_ms=15_000, chunk_min=5, chunk_max=50,
             fallback_per_region=30, prefetch_ms=2_000, active_horizon_ms=10_000),
        Pool(id="global-read", window_ms=1_000, limit=40_000, lease_ttl_ms=1_000, chunk_min=100, chunk_max=2_000,
             fallback_per_region=4_000, prefetch_ms=200, active_horizon_ms=5_000, chunk_validity_ms=250),
    ]
    rules = keep + [
        make_rule(id="tenant-atlas-global", scope="tenant", tenant="atlas", algorithm="pool", pool="atlas-minute",
             cost=1, fail_mode="local_bounded"),
        make_rule(id="tenant-birch-global", scope="tenant", tenant="birch", algorithm="pool", pool="birch-minute",
             cost=1, fail_mode="local_bounded"),
        make_rule(id="global-catalog", scope="global", route_group="read", algorithm="pool", pool="global-read",
             cost=1, fail_mode="local_bounded"),
        # docs/invariants.md I14: the operators' health-probe path is a privileged bypass with its own small cap
        # (60 per minute), an owner, failing closed; every use is audited (region_agent/audit.py)
        make_rule(id="ops-probe-bypass", scope="tenant", tenant="northstar-ops", route_group="probe",
             algorithm="fixed_window", limit=60, window_ms=60_000, fail_mode="closed", exempt=True,
             owner="sre-oncall"),
    ]
    return seal(Bundle(bundle_version=version, published_at=published_at, checksum="", rules=rules, pools=pools))


BUNDLES = {"northstar.json": northstar, "northstar-global.json": northstar_global}


def main() -> int:
    for name, make in BUNDLES.items():
        bundle = make()
        validate_bundle(bundle)
        (HERE / name).write_bytes(encode_bundle(bundle) + b"\n")
        print(f"wrote {HERE / name} (version {bundle.bundle_version}, {bundle.checksum})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
