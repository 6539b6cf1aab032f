"""The policy bundles chaos runs use: the multi-region Northstar shape with short pool
windows, so a run of tens of seconds sees many windows. Pure (no I/O but ``write``).

Pools (per window, across all regions); the bound each promises is
:func:`kernel.bound.pool_bound` (table in ``chaos/README.md``):

* ``atlas-w``: tenant pool, G = 240 per 6 s window, fallbackPerRegion 24;
* ``birch-w``: tenant pool, G = 60 per 6 s window, fallbackPerRegion 6;
* ``fleet-g``: global-scope pool spent by every tenant's ``search`` requests from in-process chunks
  (in-process chunks bought from the region's ``{g:fleet-g}`` balance, valid 1 s and never
  past the window end), G = 100 per 4 s window, fallbackPerRegion 10. Its windows are not aligned
  with the tenant pools' 6 s windows, so boundaries of both kinds occur at different moments.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import Bundle, Fallback, Pool, Rule, encode_bundle, make_rule, seal, validate_bundle

WINDOW_MS = 6_000
GLOBAL_WINDOW_MS = 4_000


def pools(scale: float = 1.0) -> list[Pool]:
    """The chaos pools; ``scale`` < 1 tightens G (and the fallbacks) for a mid-run policy change."""
    def n(x: int) -> int:
        return max(1, int(x * scale))

    return [
        Pool(id="atlas-w", window_ms=WINDOW_MS, limit=n(240), lease_ttl_ms=3_000, chunk_min=5, chunk_max=40,
             fallback_per_region=n(24), prefetch_ms=1_000, active_horizon_ms=4_000),
        Pool(id="birch-w", window_ms=WINDOW_MS, limit=n(60), lease_ttl_ms=3_000, chunk_min=2, chunk_max=12,
             fallback_per_region=n(6), prefetch_ms=1_000, active_horizon_ms=4_000),
        Pool(id="fleet-g", window_ms=GLOBAL_WINDOW_MS, limit=n(100), lease_ttl_ms=2_000, chunk_min=4, chunk_max=12,
             fallback_per_region=n(10), prefetch_ms=500, active_horizon_ms=3_000, chunk_validity_ms=1_000),
    ]


def rules() -> list[Rule]:
    return [
        # a generous per-user bucket with a small local fallback: not a pool, never the binding limit
        make_rule(id="user-all", scope="user", algorithm="token_bucket", capacity_millis=1_000_000,
             refill_millis=1_000_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=50_000, refill_millis=50_000, period_ms=1_000)),
        make_rule(id="tenant-atlas-pool", scope="tenant", tenant="atlas", algorithm="pool", pool="atlas-w", cost=1,
             fail_mode="local_bounded"),
        make_rule(id="tenant-birch-pool", scope="tenant", tenant="birch", algorithm="pool", pool="birch-w", cost=1,
             fail_mode="local_bounded"),
        # P-GLOBAL: every tenant's search requests spend the fleet-wide pool from in-process chunks
        make_rule(id="global-search", scope="global", route_group="search", algorithm="pool", pool="fleet-g", cost=1,
             fail_mode="local_bounded"),
    ]


def chaos_bundle(version: int = 7, scale: float = 1.0) -> Bundle:
    b = seal(Bundle(bundle_version=version, published_at="2026-11-30T00:00:00Z", checksum="", rules=rules(),
                    pools=pools(scale)))
    validate_bundle(b)
    return b


def with_version(b: Bundle, version: int) -> Bundle:
    """The same content under another version (a rollback published as a higher version)."""
    return seal(msgspec.structs.replace(b, bundle_version=version, checksum=""))


def write(path: Path, bundle: Bundle) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_bundle(bundle))
    return path
