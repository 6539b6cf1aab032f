"""A rule of the policy bundle, and what each algorithm says about itself (its strategy).

A rule is one msgspec Struct per algorithm, tagged by the ``algorithm`` field (the bundle's JSON
is unchanged: the tag is the field it always had). :class:`RuleBase` holds the fields every rule
has; each algorithm's module (``kernel/algorithms/<name>.py``) defines its Struct with its own
fields and registers it with :func:`algorithm`. A Struct answers, for its algorithm:

* :meth:`~RuleBase.problems` — its own validation (``kernel.bundle`` adds what every rule needs);
* :attr:`~RuleBase.kind` and :meth:`~RuleBase.script_params` — its slot in a ``multi_rule.lua``
  call (the kind names the Lua library and the reference model);
* :meth:`~RuleBase.limit_tokens`, :meth:`~RuleBase.remaining_tokens`, :meth:`~RuleBase.policy_window_ms`,
  :meth:`~RuleBase.rate` — what a decision record and the RateLimit / RLS fields report;
* :attr:`~RuleBase.local_model` and :meth:`~RuleBase.fallback_call` — what answers for it in
  process while Redis is unreachable;
* :meth:`~RuleBase.capacity` — what one key of it admits (the bypass audit compares versions).
* :attr:`~RuleBase.exact_hint` — whether a denial's retry hint is exact (the agent's negative
  cache holds such a denial for the whole hint).

Everything here is pure and computed from the rule alone, so a caller may precompute it once per
policy snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, NamedTuple, TypeVar

from msgspec import Meta, Struct

from .common import Kind

if TYPE_CHECKING:
    from kernel.bundle import Pool

MAX_INT = 2**40  # every numeric policy field is an integer in [1, 2^40] (slack in [0, 2^40])
MAX_PRODUCT = 2**52  # capacity x period stays below 2^53 inside Lua doubles

PosInt = Annotated[int, Meta(ge=1, le=MAX_INT)]
NonNegInt = Annotated[int, Meta(ge=0, le=MAX_INT)]

Scope = Literal["user", "key", "route", "tenant", "ip", "global"]
FailMode = Literal["local_bounded", "closed", "open"]
Params = tuple[int, int, int, int, int]  # one slot's five ARGV parameters


class Role(StrEnum):
    """What a slot of a multi-rule call does: a rate rule, the concurrency gate riding on a rule,
    or a spend of leased pool tokens."""

    RATE = "rate"
    CC = "cc"
    POOL = "pool"


class LocalModel(Enum):
    """What decides for a rule in process while its Redis is unreachable (failMode local_bounded)."""

    FALLBACK = "fallback"  # the rule's ``fallback``: a token bucket or a fixed window per key (LRU-bounded)
    POOL_ALLOWANCE = "pool_allowance"  # the pool's fallbackPerRegion per allocator window, one per pool


class Rate(NamedTuple):
    """A sustained rate: ``millis`` millitokens per ``per_ms``; ``scalable``: the same rate over a
    longer or shorter period (a bucket's refill) rather than a count per fixed window."""

    millis: int
    per_ms: int
    scalable: bool


class Fallback(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """Per-process local allowance used when Redis is unreachable (failMode local_bounded).

    Either a token bucket (capacityMillis, refillMillis, periodMs) or a fixed window
    (limit, windowMs)."""

    capacity_millis: PosInt | None = None
    refill_millis: PosInt | None = None
    period_ms: PosInt | None = None
    limit: PosInt | None = None
    window_ms: PosInt | None = None

    @property
    def is_bucket(self) -> bool:
        return self.capacity_millis is not None

    @property
    def limit_tokens(self) -> int:
        """The allowance in whole tokens (what a fallback decision reports as its limit)."""
        return (self.capacity_millis or 0) // 1000 if self.is_bucket else self.limit or 0

    def problems(self) -> list[str]:
        bucket = (self.capacity_millis, self.refill_millis, self.period_ms)
        window = (self.limit, self.window_ms)
        if all(v is not None for v in bucket) or all(v is not None for v in window):
            return []
        return ["fallback needs capacityMillis, refillMillis and periodMs, or limit and windowMs"]


class HotChunk(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """Chunks for a hot key set (region_agent.leasing.hot_chunks, docs/bound.md): once one
    agent process is asked more than ``thresholdPerS`` times a second for the same key set (every
    rule of the request), it takes a chunk of up to ``chunkMax`` units (requests of cost 1) from the
    store at once, charged to every rule, and admits from it for at most ``validityMs`` (never past
    a window's end) without a store call. Unspent units are abandoned, never refunded: each agent
    process may admit up to ``chunkMax`` units of a rule beyond its limit (the bound's hot-key
    chunk term)."""

    threshold_per_s: Annotated[int, Meta(ge=1, le=10_000_000)]
    chunk_max: Annotated[int, Meta(ge=2, le=100_000)] = 100
    validity_ms: Annotated[int, Meta(ge=10, le=60_000)] = 250


class Approximate(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """A coarse protective rule counted in process and reconciled with Redis every ``reconcileMs``
    (kernel/approx.py): between two reconciliations one agent admits at most ``localMax``
    requests (units of cost) per key that Redis has not seen yet."""

    reconcile_ms: Annotated[int, Meta(ge=10, le=60_000)]
    local_max: PosInt


class RuleBase(Struct, rename="camel", forbid_unknown_fields=True, frozen=True, tag_field="algorithm"):
    """The fields of every rule. Not a bundle rule itself: the algorithms subclass it."""

    algorithm: ClassVar[str]  # the tag (set by :func:`algorithm`)
    kind: ClassVar[Kind]  # its slot kind in multi_rule.lua
    role: ClassVar[Role] = Role.RATE
    local_model: ClassVar[LocalModel] = LocalModel.FALLBACK
    millis: ClassVar[int] = 1  # the script's ``remaining`` units per whole token
    # a denial's retry hint is the first instant the same cost can pass (only time adds room), so
    # the agent's negative cache may hold the denial that long (region_agent/decision/negcache.py)
    exact_hint: ClassVar[bool] = True

    id: str
    scope: Scope
    fail_mode: FailMode | None = None  # required; None only so the error names the rule
    route_group: str | None = None  # None = every route group ("all")
    tenant: str | None = None  # None = every tenant
    # concurrency gate riding on the rule (the worked number P-EXPORT, docs/invariants.md)
    concurrency_max: PosInt | None = None
    concurrency_ttl_ms: PosInt = 60_000
    concurrency_retry_after_ms: PosInt = 1_000
    # behaviour
    idempotent: bool = False
    decision_ttl_ms: PosInt = 30_000
    ttl_slack_ms: NonNegInt = 5_000
    closed_retry_after_ms: PosInt = 5_000
    fallback: Fallback | None = None
    shadow: bool = False  # evaluated and counted, never enforced
    revocable: bool = False  # after the bundle's maxAgeMs, apply the conservative behaviour (I13)
    ipv4_prefix: Annotated[int, Meta(ge=8, le=32)] = 32
    ipv6_prefix: Annotated[int, Meta(ge=16, le=128)] = 64
    exempt: bool = False  # a capped bypass: replaces the tenant's other rules by its own cap
    owner: str | None = None
    # ip rules only: the pre-authentication stage of EVERY request (authenticated or not) spends
    # it, not only anonymous ones (region_agent.decision.plan: a second call before the tenant's)
    every_request: bool = False
    # tenant-tagged rate rules: chunks once a key set is hot at one agent process (None: never)
    hot_chunk: HotChunk | None = None
    # counted in process, reconciled with Redis periodically (fixed_window, sliding_counter only)
    approximate: Approximate | None = None

    @property
    def route_key(self) -> str:
        return self.route_group or "all"

    @property
    def pool_id(self) -> str | None:
        """The pool this rule spends (pool rules only)."""
        return None

    @property
    def fleet_wide(self) -> bool:
        """Spends a fleet-wide pool from in-process chunks (never in the tenant's script call)."""
        return False

    # --- the strategy: every algorithm implements these ------------------------------------------
    def problems(self, pools: Mapping[str, Pool]) -> list[str]:
        """What is wrong with this rule's algorithm fields (without the rule's name)."""
        raise NotImplementedError

    def script_params(self, cost_hint: int) -> Params:
        """The slot's five ARGV parameters for a request of ``cost_hint`` units."""
        raise NotImplementedError

    def limit_tokens(self, pools: Mapping[str, Pool]) -> int:
        """The limit in whole tokens / requests (a decision's ``limit``, RateLimit-Policy ``q``)."""
        raise NotImplementedError

    def policy_window_ms(self, pools: Mapping[str, Pool]) -> int:
        """The window the limit is advertised with (RateLimit-Policy ``w``): a bucket's full refill."""
        raise NotImplementedError

    def rate(self, pools: Mapping[str, Pool]) -> Rate:
        raise NotImplementedError

    def capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        """(sustained requests per second, burst in requests) one key admits at cost 1."""
        raise NotImplementedError

    # --- shared by the algorithms -----------------------------------------------------------------
    def remaining_tokens(self, raw: int) -> int:
        """The script's ``remaining`` (millitokens for buckets, units otherwise) in whole tokens."""
        return max(0, raw) // self.millis

    def fallback_cost_millis(self, cost_hint: int) -> int:
        """What one request costs a token-bucket fallback, in millitokens."""
        return 1000 * cost_hint

    def fallback_call(self, cost_hint: int) -> tuple[str, Params, int]:
        """The local model's slot for this rule — (kind, params, millis per token) — from its
        ``fallback`` parameters: a token bucket with them, or a fixed window. Only for
        ``local_model`` FALLBACK rules that have a fallback (bundle validation)."""
        fb = self.fallback
        assert fb is not None, "local_bounded rules carry fallback parameters (bundle validation)"
        if fb.is_bucket:
            return ("tb", (fb.capacity_millis or 1, fb.refill_millis or 1, fb.period_ms or 1,
                           self.fallback_cost_millis(cost_hint), 0), 1000)
        return ("fw", (fb.limit or 1, fb.window_ms or 1, cost_hint, 0, 0), 1)

    def fallback_capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        """What the rule admits per agent while the store is unreachable (0 when it fails closed)."""
        fb = self.fallback
        if self.fail_mode == "closed" or fb is None:
            return 0.0, 0.0
        if fb.is_bucket:
            cost = self.fallback_cost_millis(1)
            return (fb.refill_millis or 0) * 1000 / (fb.period_ms or 1) / cost, (fb.capacity_millis or 0) / cost
        return (fb.limit or 0) * 1000 / (fb.window_ms or 1), float(fb.limit or 0)


ALGORITHMS: dict[str, type[RuleBase]] = {}
R = TypeVar("R", bound=type[RuleBase])


def algorithm(cls: R) -> R:
    """Register a rule Struct under its tag (its ``algorithm`` value in the bundle)."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or tag in ALGORITHMS:
        raise ValueError(f"algorithm {tag!r}: no tag, or registered twice")
    cls.algorithm = tag
    ALGORITHMS[tag] = cls
    return cls


def missing(name: str, fields: Mapping[str, object]) -> list[str]:
    """The problem of an algorithm whose required fields are absent, or none."""
    absent = [k for k, v in fields.items() if v is None]
    return [f"{name} needs {', '.join(absent)} (integers in [1, 2^40])"] if absent else []
