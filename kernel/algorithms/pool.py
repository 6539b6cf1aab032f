"""Global pools spent from leases: the rule (:class:`PoolRule`) and the reference model of the
leased tokens parked in a pool balance (a Redis hash), which mirrors ``lua/lib/pool.lua`` and the
deposit / take / close scripts. Entries are spendable while valid_from <= now < expires_at and they
were written in the node's current incarnation (its ``master_replid``: an entry of another one
was restored from an older state and may have lost debits); a spend debits the earliest-expiring
valid lease first (ties by lease id), splitting across leases. ``incarnation`` is passed in (the
script reads INFO replication)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from .common import Kind, RuleVerdict, check_int, register_kind
from .rule import LocalModel, Params, PosInt, Rate, Role, RuleBase, algorithm

if TYPE_CHECKING:
    from kernel.bundle import Pool

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class PoolEntry:
    granted: int
    spent: int
    valid_from_ms: int
    expires_at_ms: int
    incarnation: str = ""  # the node's master_replid when deposited

    @staticmethod
    def decode(value: str) -> PoolEntry | None:
        parts = value.split(",")
        if len(parts) != 5 or not all(p.isdigit() for p in parts[:4]) or not _HEX.fullmatch(parts[4]):
            return None
        return PoolEntry(int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4])

    def encode(self) -> str:
        return f"{self.granted},{self.spent},{self.valid_from_ms},{self.expires_at_ms},{self.incarnation}"

    def valid_at(self, now_ms: int, incarnation: str = "") -> bool:
        return self.incarnation == incarnation and self.valid_from_ms <= now_ms < self.expires_at_ms


@dataclass(frozen=True, slots=True)
class PoolParams:
    cost: int  # tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", check_int(self.cost, 1, name="cost"))

    @classmethod
    def from_args(cls, p: tuple[int, ...]) -> PoolParams:
        return cls(p[0])


@dataclass(frozen=True, slots=True)
class PoolState:
    entries: Mapping[str, PoolEntry] = field(default_factory=dict)


def spendable(state: PoolState | None, now_ms: int, incarnation: str = "") -> int:
    if state is None:
        return 0
    return sum(e.granted - e.spent for e in state.entries.values()
               if e.valid_at(now_ms, incarnation) and e.granted > e.spent)


def decide(state: PoolState | None, params: PoolParams, now_ms: int, incarnation: str = ""
           ) -> tuple[RuleVerdict, PoolState | None]:
    entries = dict(state.entries) if state else {}
    have = spendable(state, now_ms, incarnation)
    if have < params.cost:
        future = [e.valid_from_ms for e in entries.values()
                  if e.incarnation == incarnation and e.valid_from_ms > now_ms]
        return RuleVerdict(False, have, (min(future) - now_ms) if future else 0), None
    valid = sorted(((e.expires_at_ms, lid) for lid, e in entries.items()
                    if e.valid_at(now_ms, incarnation) and e.granted > e.spent))
    left = params.cost
    for _, lid in valid:
        if left == 0:
            break
        e = entries[lid]
        take = min(left, e.granted - e.spent)
        entries[lid] = replace(e, spent=e.spent + take)
        left -= take
    return RuleVerdict(True, have - params.cost, 0, have), PoolState(entries)


def take(state: PoolState | None, min_tokens: int, want: int, now_ms: int, incarnation: str = "",
         per_s: int = 0, waiting: int = 0
         ) -> tuple[tuple[int, int, int, int, tuple[tuple[str, int], ...]], PoolState | None]:
    """``pool_take.lua``: ((taken, remaining, valid_for_ms, next_from_ms, debits), new state or None).
    ``per_s`` > 0 caps ``want`` at ceil(per_s x life / 1000) (never below ``min_tokens`` nor
    ``waiting``), life being the time until the earliest-expiring spendable lease ends. ``debits``:
    (lease id, tokens debited from it) in debit order (earliest-expiring first)."""
    check_int(min_tokens, 1, name="min")
    check_int(want, min_tokens, name="want")
    check_int(per_s, 0, name="per_s")
    check_int(waiting, 0, name="waiting")
    if per_s > 0 and state is not None:
        ends = [e.expires_at_ms for e in state.entries.values() if e.valid_at(now_ms, incarnation) and e.granted > e.spent]
        if ends:
            cap = max(waiting, -(-per_s * (min(ends) - now_ms) // 1000))
            want = max(min_tokens, min(want, cap))
    d, new = decide(state, PoolParams(want), now_ms, incarnation)
    if not d.allowed and d.remaining >= min_tokens:
        d, new = decide(state, PoolParams(d.remaining), now_ms, incarnation)
    if not d.allowed or new is None:
        return (0, d.remaining, 0, d.retry_after_ms, ()), None
    before = state.entries if state else {}
    debited = sorted((e.expires_at_ms, lid, e.spent - before[lid].spent) for lid, e in new.entries.items()
                     if before.get(lid) != e)
    until = debited[0][0]
    return (d.undebited - d.remaining, d.remaining, until - now_ms, 0, tuple((lid, n) for _, lid, n in debited)), new


def deposit(state: PoolState | None, lease_id: str, granted: int, valid_from_ms: int, expires_at_ms: int,
            max_entries: int, now_ms: int, incarnation: str = "") -> tuple[str, PoolState | None]:
    """('stored' | 'replay' | 'full' | 'expired', new state or None when unchanged)."""
    check_int(granted, 0, name="granted")
    entries = dict(state.entries) if state else {}
    if lease_id in entries:
        return "replay", None
    if expires_at_ms <= now_ms:
        return "expired", None
    if len(entries) >= max_entries:
        return "full", None
    entries[lease_id] = PoolEntry(granted, 0, valid_from_ms, expires_at_ms, incarnation)
    return "stored", PoolState(entries)


def close(state: PoolState | None, lease_id: str, incarnation: str = ""
          ) -> tuple[tuple[int, int, bool] | None, PoolState | None]:
    """((granted, spent, current), new state) or (None, None) when absent; ``current`` False =
    restored from an older incarnation (its spent count may be too low)."""
    entries = dict(state.entries) if state else {}
    e = entries.pop(lease_id, None)
    if e is None:
        return None, None
    return (e.granted, e.spent, e.incarnation == incarnation), PoolState(entries)


def expiry_ms(state: PoolState, now_ms: int, slack_ms: int) -> int:
    return max(e.expires_at_ms for e in state.entries.values()) - now_ms + slack_ms


# a denial by a leased pool is not recorded: the agent runs the decision again after a top-up
KIND = register_kind(Kind("pool", "POOL", "lib/pool.lua", PoolParams.from_args,
                          lambda s, p, now, member, inc: decide(s, p, now, inc), records_denial=False))


# --- the rule ---------------------------------------------------------------------------------
@algorithm
class PoolRule(RuleBase, frozen=True, tag="pool"):
    """Spends ``cost`` whole tokens (per unit of costHint) of the bundle's pool ``pool``: from the
    tenant's leased balance in the tenant's script call, or — global scope — from this agent's
    chunk of the region's fleet-wide balance. Degrades through the pool's ``fallbackPerRegion``."""

    kind: ClassVar[Kind] = KIND
    role: ClassVar[Role] = Role.POOL
    local_model: ClassVar[LocalModel] = LocalModel.POOL_ALLOWANCE
    exact_hint: ClassVar[bool] = False  # a top-up may come before the hint

    pool: str | None = None
    cost: PosInt = 1

    @property
    def pool_id(self) -> str | None:
        return self.pool

    @property
    def fleet_wide(self) -> bool:
        return self.scope == "global"

    def tokens(self, cost_hint: int) -> int:
        """Whole tokens one request of ``cost_hint`` units spends."""
        return self.cost * cost_hint

    def problems(self, pools: Mapping[str, Pool]) -> list[str]:
        p: list[str] = []
        if self.pool is None:
            p.append("algorithm pool needs a pool id")
        elif self.pool not in pools:
            p.append(f"pool {self.pool!r} is not defined in this bundle's pools "
                     f"(defined: {', '.join(sorted(pools)) or 'none'})")
        elif self.cost > pools[self.pool].limit:
            p.append(f"cost {self.cost} exceeds pool {self.pool!r} limit {pools[self.pool].limit}")
        if self.fail_mode == "open":
            p.append("a pool rule cannot fail open (unbounded admission while the allocator is "
                     "unreachable); use local_bounded (the pool's fallbackPerRegion) or closed")
        if self.scope == "ip":
            p.append("ip-scoped rules cannot spend a global pool")
        return p

    def script_params(self, cost_hint: int) -> Params:
        return (self.tokens(cost_hint), 0, 0, 0, 0)

    def limit_tokens(self, pools: Mapping[str, Pool]) -> int:
        pool = pools.get(self.pool or "")
        return pool.limit if pool is not None else 0

    def policy_window_ms(self, pools: Mapping[str, Pool]) -> int:
        pool = pools.get(self.pool or "")
        return pool.window_ms if pool is not None else 0

    def rate(self, pools: Mapping[str, Pool]) -> Rate:
        pool = pools.get(self.pool or "")
        return Rate(0, 0, False) if pool is None else Rate(pool.limit * 1000, pool.window_ms, False)

    def capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        pool = pools.get(self.pool or "")
        if pool is None:
            return 0.0, 0.0
        return pool.limit * 1000 / pool.window_ms / self.cost, pool.limit / self.cost

    def fallback_capacity(self, pools: Mapping[str, Pool]) -> tuple[float, float]:
        pool = pools.get(self.pool or "")
        if self.fail_mode == "closed" or pool is None:
            return 0.0, 0.0
        return pool.fallback_per_region * 1000 / pool.window_ms, float(pool.fallback_per_region)
