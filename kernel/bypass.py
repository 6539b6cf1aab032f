"""Privileged bypasses (``exempt`` rules, I14) compared between two bundles: the review step of
``leasehold policy validate FILE --against CURRENT``. Pure.

A bypass is identified by its rule id. Against the current bundle, a candidate's exempt rule is

* ``added``    - no exempt rule with that id today (a new rule, or an existing rule made exempt);
* ``widened``  - it admits more, or admits to more callers, in any respect: another tenant, a
  wider route group (or all), another scope, a higher sustained rate or burst (in requests of the
  rule's own cost, so an algorithm change is judged by these numbers), a more lenient fail mode
  (closed -> local_bounded), a larger allowance while the store is unreachable, a higher or removed
  concurrency cap, no longer revocable;
* ``narrowed`` / ``changed`` - every difference goes the safe way (or only the owner changed);
* ``removed``  - exempt today, not in the candidate.

Only ``added`` and ``widened`` need a reviewer (:func:`needs_review`); the rest is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .bundle import Bundle, Pool, Rule

FAIL_MODE_RANK = {"closed": 0, "local_bounded": 1, "open": 2}


@dataclass(frozen=True)
class BypassChange:
    kind: str  # added | widened | narrowed | changed | removed
    rule: str
    tenant: str | None
    owner: str | None
    details: list[str] = field(default_factory=list)

    def line(self) -> str:
        head = f"{self.kind}: bypass {self.rule!r} (tenant {self.tenant or '*'}, owner {self.owner or '-'})"
        return head + ("".join(f"\n    - {d}" for d in self.details))


def capacity(rule: Rule, pools: dict[str, Pool]) -> tuple[float, float]:
    """(sustained requests per second, burst in requests) one key of the rule admits at cost 1."""
    alg = rule.algorithm
    if alg in ("token_bucket", "gcra"):
        cost = rule.cost_millis or 1
        rate = (rule.refill_millis or 0) * 1000 / (rule.period_ms or 1) / cost
        return rate, (rule.capacity_millis or 0) / cost
    if alg == "pool":
        pool = pools.get(rule.pool or "")
        if pool is None:
            return 0.0, 0.0
        return pool.limit * 1000 / pool.window_ms / rule.cost, pool.limit / rule.cost
    limit = rule.limit or 0
    return limit * 1000 / (rule.window_ms or 1), float(limit)


def fallback_capacity(rule: Rule, pools: dict[str, Pool]) -> tuple[float, float]:
    """What the rule admits per agent while the store is unreachable (0 when it fails closed)."""
    if rule.fail_mode == "closed":
        return 0.0, 0.0
    if rule.algorithm == "pool":
        pool = pools.get(rule.pool or "")
        return (0.0, 0.0) if pool is None else (pool.fallback_per_region * 1000 / pool.window_ms,
                                                float(pool.fallback_per_region))
    fb = rule.fallback
    if fb is None:
        return 0.0, 0.0
    if fb.capacity_millis is not None:
        cost = rule.cost_millis or 1000
        return (fb.refill_millis or 0) * 1000 / (fb.period_ms or 1) / cost, fb.capacity_millis / cost
    return (fb.limit or 0) * 1000 / (fb.window_ms or 1), float(fb.limit or 0)


def _widenings(old: Rule, new: Rule, old_pools: dict[str, Pool], new_pools: dict[str, Pool]
               ) -> tuple[list[str], list[str]]:
    """(widening differences, other differences) between two versions of one exempt rule."""
    wide: list[str] = []
    other: list[str] = []

    def note(cond: bool, text: str) -> None:
        (wide if cond else other).append(text)

    if old.tenant != new.tenant:
        wide.append(f"tenant {old.tenant} -> {new.tenant}")
    if old.route_group != new.route_group:
        note(old.route_group is not None, f"routeGroup {old.route_key} -> {new.route_key}")
    if old.scope != new.scope:
        wide.append(f"scope {old.scope} -> {new.scope} (another key per caller)")
    if old.algorithm != new.algorithm:
        other.append(f"algorithm {old.algorithm} -> {new.algorithm}")
    (r0, b0), (r1, b1) = capacity(old, old_pools), capacity(new, new_pools)
    if r1 != r0:
        note(r1 > r0, f"sustained rate {r0:g} -> {r1:g} requests/s")
    if b1 != b0:
        note(b1 > b0, f"burst {b0:g} -> {b1:g} requests")
    if old.fail_mode != new.fail_mode:
        note(FAIL_MODE_RANK.get(new.fail_mode or "", 2) > FAIL_MODE_RANK.get(old.fail_mode or "", 2),
             f"failMode {old.fail_mode} -> {new.fail_mode}")
    (f0, g0), (f1, g1) = fallback_capacity(old, old_pools), fallback_capacity(new, new_pools)
    if (f1, g1) != (f0, g0):
        note(f1 > f0 or g1 > g0, f"store-unreachable allowance {f0:g}/s burst {g0:g} -> {f1:g}/s burst {g1:g}")
    if old.concurrency_max != new.concurrency_max:
        note(new.concurrency_max is None or (old.concurrency_max is not None
                                             and new.concurrency_max > old.concurrency_max),
             f"concurrencyMax {old.concurrency_max} -> {new.concurrency_max}")
    if old.revocable != new.revocable:
        note(old.revocable, f"revocable {old.revocable} -> {new.revocable}")
    if old.owner != new.owner:
        other.append(f"owner {old.owner} -> {new.owner}")
    return wide, other


def diff_bypasses(current: Bundle | None, candidate: Bundle) -> list[BypassChange]:
    """Every bypass difference between ``current`` (None: nothing published) and ``candidate``."""
    old = {r.id: r for r in (current.rules if current else []) if r.exempt}
    new = {r.id: r for r in candidate.rules if r.exempt}
    old_pools = {p.id: p for p in (current.pools if current else [])}
    new_pools = {p.id: p for p in candidate.pools}
    out: list[BypassChange] = []
    for rid, r in new.items():
        prev = old.get(rid)
        if prev is None:
            rate, burst = capacity(r, new_pools)
            out.append(BypassChange("added", rid, r.tenant, r.owner, [
                f"scope {r.scope}, routeGroup {r.route_key}, {rate:g} requests/s, burst {burst:g}, "
                f"failMode {r.fail_mode}"]))
            continue
        wide, other = _widenings(prev, r, old_pools, new_pools)
        if wide:
            out.append(BypassChange("widened", rid, r.tenant, r.owner, wide + other))
        elif other:
            narrowed = any(not d.startswith("owner ") for d in other)
            out.append(BypassChange("narrowed" if narrowed else "changed", rid, r.tenant, r.owner, other))
    for rid, r in old.items():
        if rid not in new:
            out.append(BypassChange("removed", rid, r.tenant, r.owner))
    return out


def needs_review(changes: list[BypassChange]) -> bool:
    return any(c.kind in ("added", "widened") for c in changes)
