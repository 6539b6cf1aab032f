"""The policy bundles chaos runs use: the multi-region Northstar shape with short pool
windows, so a run of tens of seconds sees many windows. Pure (no I/O but ``write``).

Pools (per window, across all regions) and the bound each promises
(``admitted <= G + Σ_regions fallbackPerRegion + local allowances while a Redis was down``):

* ``atlas-w``: G = 240 per 6 s window, fallbackPerRegion 24 -> at most 288 with two regions;
* ``birch-w``: G = 60 per 6 s window, fallbackPerRegion 6 -> at most 72.

A Redis outage adds, per agent of that region and window, the per-agent pool allowance
(``fallbackPerRegion`` tokens) — the runner writes those as ``local_allowance`` records.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import Bundle, Fallback, Pool, Rule, encode_bundle, seal, validate_bundle

WINDOW_MS = 6_000


def pools(scale: float = 1.0) -> list[Pool]:
    """The chaos pools; ``scale`` < 1 tightens G (and the fallbacks) for a mid-run policy change."""
    def n(x: int) -> int:
        return max(1, int(x * scale))

    return [
        Pool(id="atlas-w", window_ms=WINDOW_MS, limit=n(240), lease_ttl_ms=3_000, chunk_min=5, chunk_max=40,
             fallback_per_region=n(24), prefetch_ms=1_000, active_horizon_ms=4_000),
        Pool(id="birch-w", window_ms=WINDOW_MS, limit=n(60), lease_ttl_ms=3_000, chunk_min=2, chunk_max=12,
             fallback_per_region=n(6), prefetch_ms=1_000, active_horizon_ms=4_000),
    ]


def rules() -> list[Rule]:
    return [
        # a generous per-user bucket with a small local fallback: not a pool, never the binding limit
        Rule(id="user-all", scope="user", algorithm="token_bucket", capacity_millis=1_000_000,
             refill_millis=1_000_000, period_ms=1_000, cost_millis=1_000, fail_mode="local_bounded",
             fallback=Fallback(capacity_millis=50_000, refill_millis=50_000, period_ms=1_000)),
        Rule(id="tenant-atlas-pool", scope="tenant", tenant="atlas", algorithm="pool", pool="atlas-w", cost=1,
             fail_mode="local_bounded"),
        Rule(id="tenant-birch-pool", scope="tenant", tenant="birch", algorithm="pool", pool="birch-w", cost=1,
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
