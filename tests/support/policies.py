"""Bundles as files: the sample policy (``policies/northstar.json``) as a bundle and as a bundle file,
any bundle written to a file (:func:`write_bundle`), a new bundle of pools and their rules
(:func:`write_pools`); a bundle that is expensive to validate (:func:`expensive_bundle`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import (
    MAX_REQUEST_SETS,
    Bundle,
    Pool,
    Rule,
    encode_bundle,
    load_bundle_file,
    make_rule,
    seal,
)

ROOT = Path(__file__).resolve().parents[2]
NORTHSTAR = ROOT / "policies" / "northstar.json"


def northstar() -> Bundle:
    return load_bundle_file(str(NORTHSTAR))


def write_bundle(path: Path, bundle: Bundle, **changes: object) -> Bundle:
    """Write ``bundle`` (with ``changes``, sealed again) to ``path``; the bundle written."""
    b = seal(msgspec.structs.replace(bundle, **changes)) if changes else bundle
    path.write_bytes(encode_bundle(b))
    return b


def write_pools(path: Path, pools: list[Pool], rules: list[Rule] | None = None) -> Path:
    """``path``: a new sealed bundle of ``pools`` and ``rules`` (none: what the allocator reads of a
    bundle)."""
    bundle = seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=rules or [],
                         pools=pools))
    path.write_bytes(encode_bundle(bundle))
    return path


def northstar_file(directory: Path) -> Path:
    """``directory/bundle.json``: the sample bundle."""
    path = directory / "bundle.json"
    write_bundle(path, northstar())
    return path


def _bucket(id: str, **kw: object) -> Rule:
    base: dict[str, object] = dict(id=id, scope="user", route_group="read", algorithm="token_bucket",
                                   capacity_millis=20_000, refill_millis=2_000, period_ms=1_000, cost_millis=1_000,
                                   fail_mode="closed")
    base.update(kw)
    return make_rule(**base)


def expensive_bundle(version: int, *, tenants: int = 300, route_groups: int = 300) -> Bundle:
    """A sealed, unsigned bundle that costs its validation about a second (what someone who can write
    the etcd key, but holds no signing key, can write): its rules name ``tenants`` tenants and
    ``route_groups`` route groups, (tenants + 1) x (route_groups + 2) request sets to check, below
    :data:`kernel.bundle.MAX_REQUEST_SETS`. It is invalid too, and only that check finds it: a keyed
    user's request on ``read`` takes nine script slots (eight rules and a pool)."""
    assert (tenants + 1) * (route_groups + 2) <= MAX_REQUEST_SETS
    rules = [_bucket(f"t{i}", scope="tenant", tenant=f"t{i}", route_group=None) for i in range(tenants)]
    rules += [_bucket(f"g{i}", scope="route", route_group=f"g{i}") for i in range(route_groups)]
    rules += [_bucket(f"{scope}-{route or 'all'}", scope=scope, route_group=route)
              for scope in ("user", "key", "route", "tenant") for route in ("read", None)]
    rules.append(make_rule(id="pool-read", scope="global", route_group="read", algorithm="pool", pool="p",
                           fail_mode="closed"))
    return seal(Bundle(bundle_version=version, published_at="2026-12-06T12:00:00Z", checksum="", rules=rules,
                       pools=[Pool(id="p", window_ms=60_000, limit=100)]))
