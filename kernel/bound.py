"""The overshoot bound of a pool: one function of (policy, topology, faults).

docs/invariants.md I8: per pool and per pool window *as the allocator defines it*
(``index = floor(t / windowMs)`` on the allocator leader's clock)::

    admitted <= G                                   grants never exceed the pool (etcd, fenced)
              + carry-over                          0: leases and in-process chunks clamped to the window
              + lost grants                         0: grant records are etcd transactions (consensus)
              + Σ_{regions r cut off from the allocator}  F x balances(r)
              + Σ_{agent processes a cut off from their Redis}  F x keys(a)
              + RLQS                                 Envoys enforcing quota assignments (below)

where ``F = fallbackPerRegion`` and

* ``balances(r)`` — the pool's balances in region ``r``: 1 for a global-scope pool (the
  ``{g:<pool>}`` balance), one per named tenant for tenant pools (``{t:<tenant>}``). The
  regional fallback allowance is a window of ``F`` per balance in the regional Redis, shared by
  every agent of the region; only regions the pool may lease in (``regions``) can use it.
* ``keys(a)`` — the in-process allowances one agent keeps for the pool while its Redis is
  unreachable: one per pool (counted per allocator window, shared by every rule and tenant that
  spends the pool) when a ``local_bounded`` rule spends it (``closed`` rules answer 503 instead).
  A restarted agent process starts with fresh allowances, so faults count agent *processes*.

A tenant-scoped pool rule without a tenant gives every tenant its own balance and so its own
regional fallback window: that term is unbounded (``None``), and :func:`pool_bound` says so
instead of inventing a number.

**RLQS** (Envoy's rate limit quota service, docs/gateways.md): an Envoy holds quota assignments
per bucket, funded by the agent from what its region holds (so inside the terms above), and
decides locally. Two things can add to a window, per Envoy x bucket x window:

* *carry*: an assignment ends at the end of the pool window its tokens came from, but Envoy times
  it in whole seconds; a window too short for that (:func:`rlqs_clamped`) lets one assignment of
  at most ``max_assignment`` tokens run into the next window;
* *fallback*: what the Envoy's own ``no_assignment_behavior`` / ``expired_assignment_behavior``
  admit once it is cut off from its agent: 0 with deny-all (the shipped
  ``deploy/gateways/envoy-rlqs.yaml``; :func:`envoy_fallback_tokens`).

The same function serves the chaos checker (per window, with the faults that touched it), the
README tables and ``leasehold policy validate --bound``. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from .bundle import Bundle, Pool, Rule


class Topology(Struct, frozen=True):
    """Regions and the number of agent processes in each."""

    agents: dict[str, int]  # region -> agents

    @classmethod
    def uniform(cls, regions: int | Sequence[str], agents_per_region: int = 1) -> Topology:
        names = [f"region-{i + 1}" for i in range(regions)] if isinstance(regions, int) else list(regions)
        if not names or agents_per_region < 1:
            raise ValueError("a topology needs at least one region and one agent per region")
        return cls(agents={r: agents_per_region for r in names})

    @property
    def regions(self) -> list[str]:
        return list(self.agents)


class Faults(Struct, frozen=True):
    """What was unreachable at some moment of one pool window.

    ``allocator_unreachable``: regions that could not reach the allocator (their regional
    fallback allowance may be spent). ``redis_unreachable``: per region, the agent processes
    that could not reach the regional Redis (each may spend its in-process allowances; an agent
    restarted during the outage counts twice). ``envoys_cut_off``: per region, the Envoys
    enforcing RLQS assignments that could not reach their agent (each may spend what its own
    fallback behaviour admits)."""

    allocator_unreachable: frozenset[str] = frozenset()
    redis_unreachable: dict[str, int] = {}
    envoys_cut_off: dict[str, int] = {}  # region -> Envoys (RLQS) that could not reach their agent

    @classmethod
    def worst(cls, topology: Topology) -> Faults:
        """Every region cut off from the allocator and every agent from its Redis."""
        return cls(frozenset(topology.agents), dict(topology.agents))

    @classmethod
    def allocator_only(cls, topology: Topology) -> Faults:
        return cls(frozenset(topology.agents), {})


NO_FAULTS = Faults()


class PoolShape(Struct, frozen=True):
    """What the bound needs to know about a pool: its numbers and how the rules spend it."""

    id: str
    limit: int  # G per window
    window_ms: int
    fallback_per_region: int  # F
    chunk_max: int
    global_scope: bool  # spent by a global-scope rule (chunks)
    balances: int | None  # regional balances per region (None: one per tenant, unbounded)
    local_keys: int | None  # in-process allowances per agent (None: unbounded)
    regions: tuple[str, ...] | None = None  # regions that may lease it (None: any)
    hot_chunks: bool = False  # a rule spending it takes hot-key chunks (hotChunk)

    @classmethod
    def plain(cls, pool_id: str, limit: int, window_ms: int, fallback_per_region: int, *, chunk_max: int = 1,
              global_scope: bool = False) -> PoolShape:
        """One balance per region and one in-process allowance per agent (a pool spent by one rule)."""
        return cls(pool_id, limit, window_ms, fallback_per_region, chunk_max, global_scope, 1, 1)


def shape_of(pool: Pool, rules: Iterable[Rule]) -> PoolShape:
    """The pool as the agent spends it (mirrors ``region_agent``'s keys: the regional balance and
    its fallback window are per (pool, tenant tag); the in-process allowance is per pool)."""
    spenders = [r for r in rules if r.pool_id == pool.id and not r.shadow]
    degrading = [r for r in spenders if r.fail_mode == "local_bounded"]
    balances: int | None = None
    if not any(r.scope != "global" and r.tenant is None for r in degrading):
        tenants = {r.tenant for r in degrading if r.scope != "global"}
        balances = len(tenants) + (1 if any(r.scope == "global" for r in degrading) else 0)
    local_keys = 1 if degrading else 0
    return PoolShape(id=pool.id, limit=pool.limit, window_ms=pool.window_ms,
                     fallback_per_region=pool.fallback_per_region, chunk_max=pool.chunk_max,
                     global_scope=any(r.scope == "global" for r in spenders), balances=balances,
                     local_keys=local_keys, regions=tuple(pool.regions) if pool.regions is not None else None,
                     hot_chunks=any(r.hot_chunk is not None for r in spenders))


def pool_shapes(bundle: Bundle) -> list[PoolShape]:
    return [shape_of(p, bundle.rules) for p in bundle.pools]


class Term(Struct, frozen=True):
    name: str
    tokens: int | None  # None: unbounded
    formula: str  # how the number arises, e.g. "2 regions x 1 balance x 100"


class PoolBound(Struct, frozen=True):
    pool: str
    window_ms: int
    limit: int
    terms: tuple[Term, ...]
    total: int | None  # None: unbounded
    per_region: dict[str, int | None]  # non-lease allowance per region (regional fallback + in-process)

    def term(self, name: str) -> Term:
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def overshoot(self) -> int | None:
        return None if self.total is None else self.total - self.limit


G, CARRY, LOST, REGIONAL, LOCAL, RLQS = ("G", "carry-over", "lost grants", "regional fallback", "in-process",
                                         "RLQS")
HOT = "hot-key chunks"

#: Envoy's rate limit quota filter (1.40) counts an assignment's time to live in whole seconds.
RLQS_TTL_GRANULARITY_MS = 1_000
#: The agent's default margin (``--rlqs-clock-margin-ms``): an assignment ends at least this long
#: before the window end on the agent's clock (clock offsets, the stream's delivery).
RLQS_DEFAULT_MARGIN_MS = 250


def rlqs_clamped(window_ms: int, margin_ms: int = RLQS_DEFAULT_MARGIN_MS) -> bool:
    """Can an RLQS assignment funded from a window of ``window_ms`` end at that window's end?
    Only when the window leaves a whole second after the margin; a shorter one (the sample's 1 s
    ``global-read``) lets an assignment run into the next window."""
    return window_ms - margin_ms >= RLQS_TTL_GRANULARITY_MS


def envoy_fallback_tokens(no_assignment: str, expired: str | None) -> int | None:
    """Tokens per Envoy x bucket x window that Envoy admits on its own once cut off from its
    agent, from its bucket settings: ``no_assignment`` and ``expired`` (the fallback of
    ``expired_assignment_behavior``; None when unset: Envoy reverts to ``no_assignment``) are
    ``DENY_ALL``, ``ALLOW_ALL`` or ``token_bucket``. Only deny-all is bounded (0): Envoy starts a
    token-bucket fallback afresh at every lapse of an assignment (window ends, every outage), so
    it has no per-window bound, and allow-all none at all. (Envoy 1.40 crashes on a token bucket
    as ``no_assignment_behavior``.)"""
    behaviours = [no_assignment] + ([expired] if expired is not None else [])
    return 0 if all(b == "DENY_ALL" for b in behaviours) else None


class RlqsShape(Struct, frozen=True):
    """Envoys that enforce quota assignments funded from a pool (docs/gateways.md, RLQS)."""

    envoys: dict[str, int]  # region -> Envoys whose buckets spend the pool
    buckets: int | None  # buckets per Envoy that spend the pool (None: unbounded)
    max_assignment: int  # tokens of one assignment at most (the agent's --rlqs-max-assignment)
    fallback: int | None = 0  # envoy_fallback_tokens of their bucket settings (0: deny-all)
    margin_ms: int = RLQS_DEFAULT_MARGIN_MS


def rlqs_term(shape: RlqsShape | None, window_ms: int, faults: Faults = NO_FAULTS,
              regions: Sequence[str] | None = None) -> Term:
    """The RLQS term of one window of ``window_ms``: carry (every Envoy x bucket, when the window
    is too short to clamp an assignment to it) + fallback (every Envoy cut off from its agent x
    bucket). ``regions``: the regions that may spend the pool (None: every region of ``shape``).
    Also the term of a rule without windows (a token bucket: ``window_ms`` 0): its assignments are
    not clamped, so each Envoy x bucket may hold one assignment of it across any span."""
    if shape is None or not shape.envoys:
        return Term(RLQS, 0, "no Envoy holds quota assignments")
    envoys = {r: n for r, n in shape.envoys.items() if regions is None or r in regions}
    n_envoys = sum(envoys.values())
    cut = sum(min(n, max(0, faults.envoys_cut_off.get(r, 0))) for r, n in envoys.items())
    b = "?" if shape.buckets is None else str(shape.buckets)
    clamped = window_ms > 0 and rlqs_clamped(window_ms, shape.margin_ms)
    carry = 0 if clamped else _times(n_envoys, _times(shape.buckets, shape.max_assignment))
    fallback = 0 if cut == 0 else _times(cut, _times(shape.buckets, shape.fallback))
    tokens = None if carry is None or fallback is None else carry + fallback
    carry_txt = ("assignments end at the window end" if clamped else
                 f"{_plural(n_envoys, 'Envoy')} x {b} bucket(s) x {shape.max_assignment} (an assignment "
                 + ("outlives a window this short)" if window_ms > 0 else "is held across any span)"))
    fb = "unbounded" if shape.fallback is None else str(shape.fallback)
    return Term(RLQS, tokens, f"{carry_txt}; {_plural(cut, 'Envoy')} cut off from its agent x {b} bucket(s) "
                              f"x fallback {fb}")


def _times(n: int | None, what: int | None) -> int | None:
    return None if n is None or what is None else n * what


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def pool_bound(shape: PoolShape, topology: Topology, faults: Faults = NO_FAULTS, *,
               clamped: bool = True, rlqs: RlqsShape | None = None) -> PoolBound:
    """The most one pool window may admit across all regions, term by term.

    ``clamped=False`` is an unclamped design (not ours, for comparison): every region may carry one
    chunk (``chunkMax`` per balance) over the window boundary, and for a global-scope pool
    every agent one in-process chunk as well. ``rlqs``: the Envoys holding quota assignments of the
    pool (:func:`rlqs_term`; None: no Envoy does)."""
    f = shape.fallback_per_region
    eligible = [r for r in topology.agents if shape.regions is None or r in shape.regions]
    cut = [r for r in eligible if r in faults.allocator_unreachable]
    per_region: dict[str, int | None] = {}
    regional_total: int | None = 0
    local_total: int | None = 0
    for region in topology.agents:
        regional = _times(shape.balances, f) if region in cut else 0
        local_agents = max(0, faults.redis_unreachable.get(region, 0))
        local = _times(local_agents, _times(shape.local_keys, f)) if local_agents else 0
        per_region[region] = None if regional is None or local is None else regional + local
        regional_total = None if regional_total is None or regional is None else regional_total + regional
        local_total = None if local_total is None or local is None else local_total + local
    n_local = sum(max(0, faults.redis_unreachable.get(r, 0)) for r in topology.agents)
    bal = "?" if shape.balances is None else str(shape.balances)
    keys = "?" if shape.local_keys is None else str(shape.local_keys)
    if clamped:
        carry = Term(CARRY, 0, "leases (and in-process chunks) end at the window end")
    else:
        regions_carry = _times(len(eligible), _times(shape.balances, shape.chunk_max))
        agents_carry = sum(topology.agents[r] for r in eligible) * shape.chunk_max if shape.global_scope else 0
        total_carry = None if regions_carry is None else regions_carry + agents_carry
        carry = Term(CARRY, total_carry, f"{_plural(len(eligible), 'region')} x {bal} balance(s) x chunkMax "
                     f"{shape.chunk_max}" + (f" + {agents_carry} in in-process chunks" if agents_carry else ""))
    terms = (
        Term(G, shape.limit, f"G per {shape.window_ms} ms window"),
        carry,
        Term(LOST, 0, "grants are etcd transactions fenced by the leader's epoch"),
        Term(REGIONAL, regional_total,
             f"{_plural(len(cut), 'region')} cut off from the allocator x {bal} balance(s) x F {f}"),
        Term(LOCAL, local_total,
             f"{_plural(n_local, 'agent')} cut off from Redis x {keys} allowance(s) x F {f}"),
        rlqs_term(rlqs, shape.window_ms, faults, eligible),
        Term(HOT, 0, "chunks of a hot key set end with the leases they were charged to" if shape.hot_chunks
             else "no rule spending the pool takes hot-key chunks"),
    )
    total: int | None = 0
    for t in terms:
        total = None if total is None or t.tokens is None else total + t.tokens
    return PoolBound(pool=shape.id, window_ms=shape.window_ms, limit=shape.limit, terms=terms, total=total,
                     per_region=per_region)


def bundle_bounds(bundle: Bundle, topology: Topology, faults: Faults | Mapping[str, Faults] = NO_FAULTS, *,
                  rlqs: RlqsShape | None = None) -> list[PoolBound]:
    """Every pool of a bundle; ``faults`` for all pools or per pool id."""
    out = []
    for shape in pool_shapes(bundle):
        fl = faults.get(shape.id, NO_FAULTS) if isinstance(faults, Mapping) else faults
        out.append(pool_bound(shape, topology, fl, rlqs=rlqs))
    return out


# ----------------------------------------------------------------------------- hot-key chunks
#: Algorithms whose hot-key chunks end with the window they were charged to: nothing spent from a
#: chunk falls in another window of the rule than its units were counted in.
WINDOW_CLAMPED = frozenset({"fixed_window", "pool"})


def hot_chunk_term(rule: Rule, topology: Topology, region: str | None = None) -> Term:
    """What a rule's hot-key chunks (``hotChunk``, region_agent.leasing.hot_chunks) may admit
    beyond its limit, per key of the rule and per window of the rule, in ``region`` (None: the
    region with the most agent processes): the store charged every chunk's units when it was
    taken, but they are spent up to ``validityMs`` later, so a window that starts after the take
    may see them too — at most ``chunkMax`` units per agent process (an agent holds no more of one
    key in all its chunks). 0 for a fixed window and a pool (a chunk ends with the window or lease
    it was charged to). Per region: every region's Redis holds its own buckets."""
    hot = rule.hot_chunk
    if hot is None:
        return Term(HOT, 0, "no hot-key chunks")
    if rule.algorithm in WINDOW_CLAMPED:
        return Term(HOT, 0, "chunks end with the window (or lease) they were charged to")
    agents = topology.agents.get(region, 0) if region is not None else max(topology.agents.values(), default=0)
    return Term(HOT, agents * hot.chunk_max, f"{agents} agent process{'' if agents == 1 else 'es'} x chunkMax {hot.chunk_max} "
                                             f"(units of cost 1) per key and window")


def hot_chunk_terms(bundle: Bundle, topology: Topology) -> list[tuple[Rule, Term]]:
    """Every rule of ``bundle`` that takes hot-key chunks, with its term."""
    return [(r, hot_chunk_term(r, topology)) for r in bundle.rules if r.hot_chunk is not None]


# --------------------------------------------------------------------------------------------
# Rules the pool bound above does not cover (docs/bound.md, "Approximate rules", "Split tenants").
from .approx import ApproxBound, approximate_bound  # noqa: E402  (appended section; kernel/approx.py has the proof)
from .split import SplitShare, split_shares  # noqa: E402


def approximate_bounds(bundle: Bundle, agents: int) -> list[ApproxBound]:
    """Per approximate rule: the most one key counts in one window with ``agents`` agent processes
    counting it (``limit + (agents - 1) x localMax``: kernel/approx.py)."""
    return [approximate_bound(r, agents) for r in bundle.rules if r.approximate is not None]


def split_bounds(bundle: Bundle) -> list[SplitShare]:
    """Per split tenant and divided rule: the shares, what one principal can take, and the tenant
    total's range (kernel/split.py). A split adds no overshoot term: the shares add up to the limit."""
    return split_shares(bundle.tenant_splits, bundle.rules)
