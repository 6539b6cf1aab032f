"""Build the sample policy bundles and write them sealed (checksum filled in).

    .venv/bin/python policies/build.py            # writes policies/*.json

The Northstar bundle reproduces the seed's figures: P-READ (read-user-v3), P-TENANT
(tenant-atlas-minute), P-EXPORT (export-tenant), P-ANON (anon-login) and tenant Birch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator.contract.bundle import Bundle, Fallback, Rule, encode_bundle, seal, validate_bundle  # noqa: E402

HERE = Path(__file__).resolve().parent


def northstar(version: int = 42, published_at: str = "2026-11-06T09:30:00Z") -> Bundle:
    rules = [
        # P-READ: 20 tokens, 2 per second per user on the read group; local fallback 5 and 0.25/s
        Rule(id="read-user-v3", scope="user", route_group="read", algorithm="token_bucket",
             capacity_millis=20_000, refill_millis=2_000, period_ms=1_000, cost_millis=1_000,
             fail_mode="local_bounded", fallback=Fallback(capacity_millis=5_000, refill_millis=250, period_ms=1_000)),
        # P-TENANT: Atlas may spend 1,000 per minute on every route group
        Rule(id="tenant-atlas-minute", scope="tenant", tenant="atlas", algorithm="token_bucket",
             capacity_millis=1_000_000, refill_millis=1_000_000, period_ms=60_000, cost_millis=1_000,
             fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=50_000, refill_millis=1_000_000, period_ms=60_000),
             ttl_slack_ms=5_000),
        # P-EXPORT: weighted cost 10, at most 3 in flight per tenant, fail closed, idempotent
        Rule(id="export-tenant", scope="tenant", route_group="export", algorithm="token_bucket",
             capacity_millis=1_000_000, refill_millis=1_000_000, period_ms=60_000, cost_millis=10_000,
             concurrency_max=3, concurrency_ttl_ms=60_000, concurrency_retry_after_ms=5_000,
             fail_mode="closed", idempotent=True, decision_ttl_ms=30_000, closed_retry_after_ms=5_000),
        # P-ANON: 20 requests per 10 s per client address on /login; local fixed window 5 per 10 s
        Rule(id="anon-login", scope="ip", route_group="login", algorithm="fixed_window", limit=20,
             window_ms=10_000, fail_mode="local_bounded", fallback=Fallback(limit=5, window_ms=10_000)),
        # Birch: a smaller tenant, 300 per minute on every route group
        Rule(id="tenant-birch-minute", scope="tenant", tenant="birch", algorithm="token_bucket",
             capacity_millis=300_000, refill_millis=300_000, period_ms=60_000, cost_millis=1_000,
             fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=20_000, refill_millis=300_000, period_ms=60_000)),
    ]
    return seal(Bundle(bundle_version=version, published_at=published_at, checksum="", rules=rules))


BUNDLES = {"northstar.json": northstar}


def main() -> int:
    for name, make in BUNDLES.items():
        bundle = make()
        validate_bundle(bundle)
        (HERE / name).write_bytes(encode_bundle(bundle) + b"\n")
        print(f"wrote {HERE / name} (version {bundle.bundle_version}, {bundle.checksum})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
