"""The policy *source*: the form people write (YAML, ``docs/policy.md``), with unit strings —
``rate: 2/s``, ``burst: 20``, ``limit: 20/10s``, ``window: 10s``, ``cost: 10``,
``concurrency: 3``, fail modes by name — and its compilation to the canonical bundle
(:class:`kernel.bundle.Bundle`: the JSON the services load and etcd stores, which stays the
contract). Pure: no I/O (the YAML adapter is :mod:`kernel.policy_yaml`).

The source is typed by the msgspec Structs below, so its JSON Schema (``docs/schema/``) is
generated from them, like the bundle's. One source Struct per algorithm, tagged by
``algorithm`` as in the bundle; a test holds the two sets of algorithms equal.

Units. ``rate: A/D`` is A tokens (up to 3 decimals: millitokens) per duration D
(``500ms``, ``s``, ``10s``, ``min``, ``2h``, ``d``; a bare unit is 1 of it); ``burst`` and
``cost`` are tokens (up to 3 decimals); ``limit: N/D`` is N whole requests per window D (or
``limit: N`` with ``window: D``); every other duration is ``<integer><unit>``. Durations are
exact integers of milliseconds; nothing is rounded.

:func:`compile_source` turns a decoded source into a sealed bundle; :func:`decompile` turns a
bundle back into a source document (fields at their default are left out), and
``compile(decompile(b)) == b`` for every bundle.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, get_args

import msgspec
from msgspec import Meta, Struct

from .algorithms import ALGORITHMS
from .algorithms.rule import Approximate, FailMode, HotChunk, NonNegInt, PosInt, Scope
from .bundle import Bundle, Pool, seal
from .split import TenantSplit

# ------------------------------------------------------------------------------ unit strings
UNITS_MS: dict[str, int] = {"ms": 1, "s": 1_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
_UNIT_ALT = "ms|s|min|h|d"
DURATION_PATTERN = rf"^(0|[1-9][0-9]*)({_UNIT_ALT})\Z"
RATE_PATTERN = rf"^(0|[1-9][0-9]*)(\.[0-9]{{1,3}})?/([1-9][0-9]*)?({_UNIT_ALT})\Z"
_DURATION_RE = re.compile(DURATION_PATTERN)
_RATE_RE = re.compile(RATE_PATTERN)

Duration = Annotated[str, Meta(pattern=DURATION_PATTERN, examples=["500ms", "10s", "1min"],
                               description="an integer and a unit: ms, s, min, h, d")]
Rate = Annotated[str, Meta(pattern=RATE_PATTERN, examples=["2/s", "1000/min", "0.25/s", "20/10s"],
                           description="tokens (up to 3 decimals) per duration: A/D where D is a unit "
                                       "(ms, s, min, h, d) or an integer and a unit")]
Tokens = Annotated[int, Meta(ge=1, description="whole tokens")] | Annotated[
    float, Meta(gt=0, description="tokens, up to 3 decimals (millitokens)")]
WindowLimit = int | Annotated[str, Meta(pattern=RATE_PATTERN, examples=["20/10s", "1000/min"])]


class SourceError(ValueError):
    """A value the types let through but the units do not (e.g. a 4th decimal); ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def duration_ms(text: str, field: str = "duration") -> int:
    m = _DURATION_RE.fullmatch(text)
    if m is None:
        raise SourceError(field, f"{field} {text!r} is not a duration (an integer and one of "
                                 f"{', '.join(UNITS_MS)}: e.g. 10s, 500ms, 1min)")
    return int(m.group(1)) * UNITS_MS[m.group(2)]


def rate_parts(text: str, field: str = "rate") -> tuple[Decimal, int]:
    """``'2/s'`` -> (Decimal 2, 1000): the amount and the period in ms."""
    m = _RATE_RE.fullmatch(text)
    if m is None:
        raise SourceError(field, f"{field} {text!r} is not a rate (tokens per duration: e.g. 2/s, 1000/min, "
                                 f"0.25/s, 20/10s; units {', '.join(UNITS_MS)})")
    amount = Decimal(m.group(1) + (m.group(2) or ""))
    period = int(m.group(3) or 1) * UNITS_MS[m.group(4)]
    return amount, period


def millis(value: int | float | Decimal, field: str) -> int:
    """Tokens (up to 3 decimals) as integer millitokens."""
    try:
        d = value if isinstance(value, Decimal) else Decimal(repr(value) if isinstance(value, float) else value)
    except InvalidOperation:
        raise SourceError(field, f"{field} {value!r} is not a number") from None
    if not d.is_finite():
        raise SourceError(field, f"{field} {value} is not a finite number of tokens")
    m = d * 1000
    if m != m.to_integral_value():
        raise SourceError(field, f"{field} {value} has more than 3 decimals (the unit is a millitoken)")
    return int(m)


def whole(value: Decimal, field: str) -> int:
    if value != value.to_integral_value():
        raise SourceError(field, f"{field} must be a whole number of requests (got {value})")
    return int(value)


def format_duration(ms: int) -> str:
    for unit in ("d", "h", "min", "s"):
        if ms and ms % UNITS_MS[unit] == 0:
            return f"{ms // UNITS_MS[unit]}{unit}"
    return f"{ms}ms"


def format_amount(millis_value: int) -> int | float:
    """Millitokens as tokens: an int when whole, else the exact decimal as a float (3 decimals)."""
    if millis_value % 1000 == 0:
        return millis_value // 1000
    return float(Decimal(millis_value) / 1000)


def format_rate(amount_millis: int, period_ms: int) -> str:
    a = format_amount(amount_millis)
    d = format_duration(period_ms)
    n = re.match(r"^(\d+)", d)
    if n and n.group(1) == "1" and not d.endswith("ms"):
        d = d[1:]  # "2/s", "1000/min"
    return f"{a}/{d}"


# ------------------------------------------------------------------------------ the source types
class SourceFallback(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """What answers in process while the store is unreachable (failMode local_bounded): a token
    bucket (``rate`` and ``burst``) or a fixed window (``limit``, with ``window`` or as N/D)."""

    rate: Rate | None = None
    burst: Tokens | None = None
    limit: WindowLimit | None = None
    window: Duration | None = None


class SourceRule(Struct, rename="camel", forbid_unknown_fields=True, frozen=True, tag_field="algorithm",
                 kw_only=True):
    """The fields of every rule (not a rule itself: one subclass per algorithm)."""

    id: str
    scope: Scope
    fail_mode: FailMode
    route_group: str | None = None  # absent: every route group
    tenant: str | None = None  # absent: every tenant
    concurrency: PosInt | None = None  # requests in flight per key (a concurrency gate)
    concurrency_ttl: Duration | None = None
    concurrency_retry_after: Duration | None = None
    idempotent: bool = False
    decision_ttl: Duration | None = None
    ttl_slack: Duration | None = None
    closed_retry_after: Duration | None = None
    fallback: SourceFallback | None = None
    shadow: bool = False
    revocable: bool = False
    ipv4_prefix: Annotated[int, Meta(ge=8, le=32)] | None = None
    ipv6_prefix: Annotated[int, Meta(ge=16, le=128)] | None = None
    exempt: bool = False
    owner: str | None = None
    every_request: bool = False  # ip rules: the pre-authentication stage of every request
    hot_chunk: HotChunk | None = None  # chunks for a hot key set (as in the bundle)
    approximate: Approximate | None = None  # counted in process, reconciled every reconcileMs (kernel/approx.py)


class BucketSource(SourceRule, frozen=True):
    rate: Rate  # the refill
    burst: Tokens  # the capacity
    cost: Tokens = 1  # per unit of the request's costHint


class TokenBucketSource(BucketSource, frozen=True, tag="token_bucket"):
    """A token bucket: ``burst`` tokens, refilled at ``rate``."""


class GcraSource(BucketSource, frozen=True, tag="gcra"):
    """GCRA with a token bucket's parameters."""


class WindowSource(SourceRule, frozen=True):
    limit: WindowLimit  # N/D, or N with window: D
    window: Duration | None = None


class FixedWindowSource(WindowSource, frozen=True, tag="fixed_window"):
    """At most ``limit`` requests per aligned window."""


class SlidingCounterSource(WindowSource, frozen=True, tag="sliding_counter"):
    """The sliding-window counter (weighted previous window)."""


class SlidingLogSource(WindowSource, frozen=True, tag="sliding_log"):
    """The exact sliding log."""


class PoolSource(SourceRule, frozen=True, tag="pool"):
    """Spends ``cost`` tokens per request of the bundle's global pool ``pool``."""

    pool: str
    cost: PosInt = 1


SOURCE_RULES: dict[str, type[SourceRule]] = {
    c.__struct_config__.tag: c  # type: ignore[misc]  # every source rule Struct is tagged with a str
    for c in (TokenBucketSource, GcraSource, FixedWindowSource, SlidingCounterSource, SlidingLogSource, PoolSource)
}
SourceRuleUnion: Any = TokenBucketSource | GcraSource | FixedWindowSource | SlidingCounterSource | SlidingLogSource \
    | PoolSource


class SourcePool(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """A global quota held by the allocator: ``limit`` whole tokens per window across all regions."""

    id: str
    limit: Annotated[str, Meta(pattern=RATE_PATTERN, examples=["1000/min", "40000/s"])]
    lease_ttl: Duration | None = None
    chunk_min: PosInt | None = None
    chunk_max: PosInt | None = None
    fallback_per_region: NonNegInt | None = None
    prefetch: Duration | None = None
    active_horizon: Duration | None = None
    chunk_validity: Duration | None = None
    regions: list[str] | None = None


class PolicySource(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """A policy source file: compiled by ``leasehold policy compile`` into the sealed bundle."""

    version: PosInt
    published_at: str
    rules: list[SourceRuleUnion]
    pools: list[SourcePool] = []
    max_age: Duration | None = None  # snapshot freshness for revocable rules
    tenant_splits: list[TenantSplit] = []  # very large tenants over k slots (kernel/split.py)


# ------------------------------------------------------------------------------ compile
# (source field, bundle field) of the fields every rule has that convert by a duration or as is
_DURATIONS = (("concurrency_ttl", "concurrency_ttl_ms"), ("concurrency_retry_after", "concurrency_retry_after_ms"),
              ("decision_ttl", "decision_ttl_ms"), ("ttl_slack", "ttl_slack_ms"),
              ("closed_retry_after", "closed_retry_after_ms"))
_AS_IS = (("scope", "scope"), ("fail_mode", "fail_mode"), ("route_group", "route_group"), ("tenant", "tenant"),
          ("concurrency", "concurrency_max"), ("idempotent", "idempotent"), ("shadow", "shadow"),
          ("revocable", "revocable"), ("ipv4_prefix", "ipv4_prefix"), ("ipv6_prefix", "ipv6_prefix"),
          ("exempt", "exempt"), ("owner", "owner"), ("every_request", "every_request"))
_POOL_DURATIONS = (("lease_ttl", "lease_ttl_ms"), ("prefetch", "prefetch_ms"), ("active_horizon", "active_horizon_ms"),
                   ("chunk_validity", "chunk_validity_ms"))
_POOL_AS_IS = (("chunk_min", "chunk_min"), ("chunk_max", "chunk_max"),
               ("fallback_per_region", "fallback_per_region"), ("regions", "regions"))

# where a bundle field comes from in the source (errors found on the bundle point at the source field)
def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


SOURCE_FIELD: dict[str, str] = {
    "capacityMillis": "burst", "refillMillis": "rate", "periodMs": "rate", "costMillis": "cost",
    "windowMs": "limit", "concurrencyMax": "concurrency", "maxAgeMs": "maxAge", "bundleVersion": "version",
    **{_camel(b): _camel(s) for s, b in _DURATIONS + _POOL_DURATIONS},
}


def _window(limit: int | str, window: str | None, field: str) -> tuple[int, int]:
    """(limit, windowMs) from ``limit: N/D`` or ``limit: N`` + ``window: D``."""
    if isinstance(limit, str):
        if window is not None:
            raise SourceError("window", f"give the window once: {field} {limit!r} already names it")
        amount, per = rate_parts(limit, field)
        return whole(amount, field), per
    if window is None:
        raise SourceError("window", f"{field} {limit} needs a window (window: 10s, or write {field}: {limit}/10s)")
    return limit, duration_ms(window, "window")


def _fallback(fb: SourceFallback) -> dict[str, Any]:
    if fb.rate is not None or fb.burst is not None:
        if fb.limit is not None or fb.window is not None:
            raise SourceError("fallback", "fallback is a token bucket (rate, burst) or a fixed window "
                                          "(limit[, window]), not both")
        if fb.rate is None or fb.burst is None:
            raise SourceError("fallback", "a token-bucket fallback needs both rate and burst")
        amount, per = rate_parts(fb.rate, "fallback rate")
        return {"capacityMillis": millis(fb.burst, "fallback burst"),
                "refillMillis": millis(amount, "fallback rate"), "periodMs": per}
    if fb.limit is None:
        raise SourceError("fallback", "fallback needs rate and burst, or limit (N/D, or N with window)")
    limit, window_ms = _window(fb.limit, fb.window, "fallback limit")
    return {"limit": limit, "windowMs": window_ms}


def rule_fields(src: SourceRule) -> dict[str, Any]:
    """The bundle rule (as keyword fields of :func:`kernel.bundle.make_rule`) of one source rule."""
    out: dict[str, Any] = {"id": src.id, "algorithm": src.__struct_config__.tag}
    for s, b in _AS_IS:
        v = getattr(src, s)
        if v is not None:
            out[b] = v
    for s, b in _DURATIONS:
        v = getattr(src, s)
        if v is not None:
            out[b] = duration_ms(v, _camel(s))
    if src.hot_chunk is not None:
        out["hot_chunk"] = src.hot_chunk
    if src.fallback is not None:
        try:
            out["fallback"] = msgspec.convert(_fallback(src.fallback), type=_fallback_type())
        except SourceError as e:
            e.field = "fallback"
            raise
    if src.approximate is not None:
        out["approximate"] = src.approximate
    if isinstance(src, BucketSource):
        amount, per = rate_parts(src.rate, "rate")
        out.update(capacity_millis=millis(src.burst, "burst"), refill_millis=millis(amount, "rate"),
                   period_ms=per, cost_millis=millis(src.cost, "cost"))
    elif isinstance(src, WindowSource):
        out["limit"], out["window_ms"] = _window(src.limit, src.window, "limit")
    elif isinstance(src, PoolSource):
        out.update(pool=src.pool, cost=src.cost)
    return out


def pool_fields(src: SourcePool) -> dict[str, Any]:
    amount, per = rate_parts(src.limit, "limit")
    out: dict[str, Any] = {"id": src.id, "limit": whole(amount, "limit"), "window_ms": per}
    for s, b in _POOL_AS_IS:
        v = getattr(src, s)
        if v is not None:
            out[b] = v
    for s, b in _POOL_DURATIONS:
        v = getattr(src, s)
        if v is not None:
            out[b] = duration_ms(v, _camel(s))
    return out


def _fallback_type() -> type:
    from .algorithms.rule import Fallback
    return Fallback


_TIMESTAMP_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})\Z")


def check_timestamp(text: str, field: str = "publishedAt") -> str:
    """``text`` when it is an RFC 3339 time with its offset (``2026-11-06T09:30:00Z``); else :class:`SourceError`."""
    from datetime import datetime

    try:
        if _TIMESTAMP_RE.fullmatch(text) is None:
            raise ValueError(text)
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SourceError(field, f"{field} {text!r} is not a time: RFC 3339 with its offset, e.g. "
                                 "'2026-11-06T09:30:00Z' (`leasehold policy bump` writes the time now)") from None
    return text


def bundle_document(src: PolicySource) -> dict[str, Any]:
    """The bundle of ``src`` as a JSON document (camelCase, unsealed: ``checksum`` empty). Raises
    :class:`SourceError` (with the rule index in ``.rule``) for a unit problem."""
    check_timestamp(src.published_at)
    rules = []
    for i, r in enumerate(src.rules):
        try:
            fields = rule_fields(r)
        except SourceError as e:
            e.rule = i  # type: ignore[attr-defined]  # attached for the error message; SourceError declares no fields
            raise
        rules.append(msgspec.to_builtins(ALGORITHMS[fields.pop("algorithm")](**fields)))
    pools = []
    for i, p in enumerate(src.pools):
        try:
            pools.append(msgspec.to_builtins(Pool(**pool_fields(p))))
        except SourceError as e:
            e.pool = i  # type: ignore[attr-defined]  # attached for the error message; SourceError declares no fields
            raise
    doc = {"bundleVersion": src.version, "publishedAt": src.published_at, "checksum": "",
           "rules": rules, "pools": pools,
           "maxAgeMs": duration_ms(src.max_age, "maxAge") if src.max_age is not None else None}
    if src.tenant_splits:
        doc["tenantSplits"] = [msgspec.to_builtins(t) for t in src.tenant_splits]
    return doc


def compile_source(src: PolicySource) -> Bundle:
    """The sealed bundle of ``src``. Raises :class:`SourceError` (units), ``msgspec.ValidationError``
    (a bundle field out of its range) or :class:`kernel.errors.PolicyError` (bundle validation):
    :mod:`kernel.policy_yaml` turns each into an error naming the file, line and rule."""
    from .bundle import validate_bundle

    bundle = seal(msgspec.convert(bundle_document(src), type=Bundle))
    validate_bundle(bundle)
    return bundle


# ------------------------------------------------------------------------------ decompile
def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in msgspec.structs.fields(cls) if f.default is not msgspec.NODEFAULT}


def _fallback_doc(fb: Any) -> dict[str, Any]:
    if fb.is_bucket:
        return {"rate": format_rate(fb.refill_millis, fb.period_ms), "burst": format_amount(fb.capacity_millis)}
    return {"limit": f"{fb.limit}/{_per(fb.window_ms)}"}


def _per(ms: int) -> str:
    return format_rate(1000, ms).split("/", 1)[1]


RULE_ORDER = ("id", "scope", "routeGroup", "tenant", "algorithm", "rate", "burst", "limit", "pool", "cost",
              "concurrency", "concurrencyTtl", "concurrencyRetryAfter", "failMode", "fallback", "closedRetryAfter",
              "idempotent", "decisionTtl", "ttlSlack", "shadow", "revocable", "ipv4Prefix", "ipv6Prefix", "exempt",
              "owner", "everyRequest", "hotChunk", "approximate")


def rule_source(rule: Any) -> dict[str, Any]:
    """One bundle rule as a source document (fields at their default left out), in :data:`RULE_ORDER`."""
    defaults = _defaults(type(rule))
    out: dict[str, Any] = {"id": rule.id, "algorithm": rule.algorithm}
    for s, b in _AS_IS:
        v = getattr(rule, b)
        if b == "fail_mode" or v != defaults.get(b):
            out[_camel(s)] = v
    if rule.algorithm in ("token_bucket", "gcra"):
        out["rate"] = format_rate(rule.refill_millis, rule.period_ms)
        out["burst"] = format_amount(rule.capacity_millis)
        if rule.cost_millis != 1000:
            out["cost"] = format_amount(rule.cost_millis)
    elif rule.algorithm == "pool":
        out["pool"] = rule.pool
        if rule.cost != 1:
            out["cost"] = rule.cost
    else:
        out["limit"] = f"{rule.limit}/{_per(rule.window_ms)}"
    for s, b in _DURATIONS:
        v = getattr(rule, b)
        if v != defaults.get(b):
            out[_camel(s)] = format_duration(v)
    if rule.fallback is not None:
        out["fallback"] = _fallback_doc(rule.fallback)
    if rule.hot_chunk is not None:
        out["hotChunk"] = msgspec.to_builtins(rule.hot_chunk)
    if rule.approximate is not None:
        out["approximate"] = msgspec.to_builtins(rule.approximate)
    return {k: out[k] for k in RULE_ORDER if k in out}


POOL_ORDER = ("id", "limit", "leaseTtl", "chunkMin", "chunkMax", "fallbackPerRegion", "prefetch", "activeHorizon",
              "chunkValidity", "regions")


def pool_source(pool: Pool) -> dict[str, Any]:
    defaults = _defaults(Pool)
    out: dict[str, Any] = {"id": pool.id, "limit": f"{pool.limit}/{_per(pool.window_ms)}"}
    for s, b in _POOL_AS_IS:
        v = getattr(pool, b)
        if v != defaults.get(b):
            out[_camel(s)] = v
    for s, b in _POOL_DURATIONS:
        v = getattr(pool, b)
        if v != defaults.get(b):
            out[_camel(s)] = format_duration(v)
    return {k: out[k] for k in POOL_ORDER if k in out}


def decompile(bundle: Bundle) -> dict[str, Any]:
    """The source document of ``bundle`` (the signature and checksum are the tool's to compute)."""
    out: dict[str, Any] = {"version": bundle.bundle_version, "publishedAt": bundle.published_at}
    if bundle.max_age_ms is not None:
        out["maxAge"] = format_duration(bundle.max_age_ms)
    out["rules"] = [rule_source(r) for r in bundle.rules]
    if bundle.pools:
        out["pools"] = [pool_source(p) for p in bundle.pools]
    if bundle.tenant_splits:
        out["tenantSplits"] = [msgspec.to_builtins(t) for t in bundle.tenant_splits]
    return out


ENUMERATED: dict[str, tuple[str, ...]] = {
    "algorithm": tuple(sorted(ALGORITHMS)),
    "scope": get_args(Scope),
    "failMode": get_args(FailMode),
}


__all__ = ["ENUMERATED", "SOURCE_FIELD", "SOURCE_RULES", "PolicySource", "SourceError", "SourcePool",
           "SourceRule", "bundle_document", "check_timestamp", "compile_source", "decompile", "duration_ms", "format_duration",
           "format_rate", "millis", "pool_source", "rate_parts", "rule_source"]
