"""A very large tenant split across k Redis Cluster slots (the bundle's ``tenantSplits``).

Every key of a tenant carries its hash tag ``{t:<tenant>}``, so one tenant lives in one slot and
one shard: a flood of attempts against it saturates that shard whatever the cluster's size. A
split gives the tenant ``k`` sub-buckets with the tags ``{t:<tenant>:0}`` .. ``{t:<tenant>:<k-1>}``
(``k`` slots, spread over the primaries like any other tags). One request goes to exactly one
sub-bucket, chosen by a keyed hash of its principal (:func:`sub_bucket`), and all of that
request's keys (its user, key, route and tenant rules, its decision record) carry that
sub-bucket's tag: the decision stays one script on one shard.

What the split changes, per rule of the split tenant (:func:`divide`):

* **user and key rules** are unchanged: a principal always hashes to the same sub-bucket, so its
  own keys stay exact.
* **route and tenant rules** are shared by the tenant's principals; their limit is divided among
  the ``k`` sub-buckets by integer division, the remainder going to the first sub-buckets:
  sub-bucket ``i`` gets ``limit // k + (1 if i < limit % k else 0)`` (token buckets and GCRA:
  ``capacityMillis`` and ``refillMillis`` alike, in millitokens; window algorithms: ``limit``;
  a concurrency gate: ``concurrencyMax``; the ``fallback`` allowance and an approximate rule's
  ``localMax`` the same way). The shares add up to the rule's limit exactly.

The slack, stated (docs/policy.md, "Split tenants"):

* a principal (and every principal hashed to the same sub-bucket with it) can take at most its
  sub-bucket's share: ``ceil(limit / k)`` at most, ``floor(limit / k)`` at least;
* the tenant's total never exceeds the undivided limit (the shares add up to it): the split adds
  no overshoot term to any bound;
* the tenant reaches its full limit only when its traffic covers all ``k`` sub-buckets; with
  every sub-bucket busy, a rule with per-request cost ``c`` admits at least ``floor(limit / c) -
  (k - 1)`` requests of what the undivided rule would (each share loses less than one request to
  rounding); with traffic in ``m < k`` sub-buckets, at most the sum of those ``m`` shares.

Changing ``k`` (or adding a split) moves the tenant's keys to other tags: its counters start
afresh, as after a key's expiry (at most one more window's limit for that tenant, once).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import msgspec
from msgspec import Struct

from .algorithms import Fallback
from .ids import TENANT_RE

if TYPE_CHECKING:
    from .algorithms.rule import RuleBase as Rule

MIN_SUB_BUCKETS = 2
MAX_SUB_BUCKETS = 64
SPLIT_SCOPES = ("route", "tenant")  # the scopes shared by a tenant's principals (their limit is divided)


class TenantSplit(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """``tenant``'s keys spread over ``subBuckets`` hash tags (slots)."""

    tenant: str
    sub_buckets: int


def share(total: int, k: int, i: int) -> int:
    """Sub-bucket ``i``'s share of ``total`` split ``k`` ways (integer division, the remainder to
    the first ``total % k`` sub-buckets). ``sum(share(total, k, i) for i in range(k)) == total``."""
    return total // k + (1 if i < total % k else 0)


def sub_bucket(pepper_hash: str, k: int) -> int:
    """The sub-bucket of a principal whose keyed hash (hex, region_agent.decision.keys.KeyBuilder.h) is
    ``pepper_hash``."""
    return int(pepper_hash, 16) % k


def principal_hash(pepper: bytes, tenant: str, principal_type: str, principal_id: str) -> str:
    """A stable keyed hash of a principal (for callers without a KeyBuilder: tests, tools)."""
    msg = (tenant + "\x1f" + "s" + "\x1f" + principal_type + "\x1f" + principal_id).encode("utf-8", "surrogatepass")
    return hmac.digest(pepper, msg, "sha256")[:8].hex()


def splits_of(splits: Iterable[TenantSplit]) -> dict[str, int]:
    return {s.tenant: s.sub_buckets for s in splits}


def _int(rule: Rule, name: str) -> int:
    """An algorithm's integer field (0 when absent or unset)."""
    return getattr(rule, name, None) or 0


def is_divided(rule: Rule) -> bool:
    return rule.scope in SPLIT_SCOPES


def _divide_fallback(fb: Fallback | None, k: int, i: int) -> Fallback | None:
    if fb is None:
        return None
    if fb.is_bucket:
        return msgspec.structs.replace(fb, capacity_millis=share(fb.capacity_millis or 0, k, i),
                                       refill_millis=share(fb.refill_millis or 0, k, i))
    return msgspec.structs.replace(fb, limit=share(fb.limit or 0, k, i))


def divide(rule: Rule, k: int, i: int) -> Rule:
    """``rule`` as sub-bucket ``i`` of ``k`` enforces it: user and key rules unchanged, route and
    tenant rules with their share of the limit (see the module doc)."""
    if not is_divided(rule):
        return rule
    changes: dict[str, object] = {}
    fields = rule.__struct_fields__
    if "capacity_millis" in fields:  # token bucket, GCRA
        changes["capacity_millis"] = share(_int(rule, "capacity_millis"), k, i)
        changes["refill_millis"] = share(_int(rule, "refill_millis"), k, i)
    elif "limit" in fields and "window_ms" in fields:  # the window algorithms
        changes["limit"] = share(_int(rule, "limit"), k, i)
    if rule.concurrency_max is not None:
        changes["concurrency_max"] = share(rule.concurrency_max, k, i)
    if rule.fallback is not None:
        changes["fallback"] = _divide_fallback(rule.fallback, k, i)
    if rule.approximate is not None:  # (so the approximate term of the k sub-keys adds up to the rule's)
        changes["approximate"] = msgspec.structs.replace(rule.approximate,
                                                         local_max=share(rule.approximate.local_max, k, i))
    return msgspec.structs.replace(rule, **changes)


def divide_all(rules: list[Rule], k: int, i: int) -> list[Rule]:
    return [divide(r, k, i) for r in rules]


def _applies_to(rule: Rule, tenant: str) -> bool:
    return rule.scope != "ip" and rule.scope != "global" and rule.tenant in (None, tenant)


def split_problems(splits: Iterable[TenantSplit], rules: Iterable[Rule], pools: Mapping[str, object]) -> list[str]:
    """What is wrong with the bundle's ``tenantSplits`` given its rules: a bad ``subBuckets``, a
    tenant split twice, a pool the tenant spends (its leased balance would be k balances), a
    divided rule whose smallest share cannot admit one request."""
    rules = list(rules)
    problems: list[str] = []
    seen: set[str] = set()
    for s in splits:
        name = f"tenantSplits {s.tenant!r}"
        if not TENANT_RE.fullmatch(s.tenant):
            problems.append(f"{name}: tenant must match {TENANT_RE.pattern}")
            continue
        if s.tenant in seen:
            problems.append(f"{name}: the tenant is split twice")
        seen.add(s.tenant)
        k = s.sub_buckets
        if not MIN_SUB_BUCKETS <= k <= MAX_SUB_BUCKETS:
            problems.append(f"{name}: subBuckets must be an integer from {MIN_SUB_BUCKETS} to {MAX_SUB_BUCKETS} "
                            f"(got {k}); leave the tenant out of tenantSplits for one slot")
            continue
        for r in rules:
            if not _applies_to(r, s.tenant):
                continue
            if r.pool_id is not None:
                if r.tenant == s.tenant:
                    problems.append(f"{name}: rule {r.id!r} spends pool {r.pool_id!r}, whose regional balance "
                                    f"would be {k} balances (one per sub-bucket); a split tenant cannot spend a "
                                    "tenant pool")
                continue
            if not is_divided(r):
                continue
            smallest = divide(r, k, k - 1)  # the last sub-bucket has the smallest share
            rname = f"{name}: rule {r.id!r} ({r.scope} scope)"
            for p in smallest.problems(pools):  # type: ignore[arg-type]  # any mapping of pools: the rule only looks ids up
                problems.append(f"{rname} divided by {k}: {p}")
            if "capacity_millis" in r.__struct_fields__:
                if _int(smallest, "refill_millis") < 1:
                    problems.append(f"{rname}: refillMillis {_int(r, 'refill_millis')} divided by {k} leaves a "
                                    "sub-bucket without refill")
            elif "limit" in r.__struct_fields__ and _int(smallest, "limit") < 1:
                problems.append(f"{rname}: limit {_int(r, 'limit')} is smaller than subBuckets {k}: a sub-bucket "
                                "would admit nothing")
            if smallest.approximate is not None and smallest.approximate.local_max < 1:
                problems.append(f"{rname}: approximate localMax {r.approximate.local_max} is smaller than "  # type: ignore[union-attr]  # the divided rule is approximate only when r is
                                f"subBuckets {k}")
            if r.concurrency_max is not None and (smallest.concurrency_max or 0) < 1:
                problems.append(f"{rname}: concurrencyMax {r.concurrency_max} is smaller than subBuckets {k}")
            fb = smallest.fallback
            if fb is not None and ((fb.is_bucket and ((fb.capacity_millis or 0) < 1 or (fb.refill_millis or 0) < 1))
                                   or (not fb.is_bucket and (fb.limit or 0) < 1)):
                problems.append(f"{rname}: its fallback allowance divided by {k} leaves a sub-bucket none")
    return problems




class SplitShare(NamedTuple):
    """A divided rule of a split tenant, in whole requests at cost 1."""

    tenant: str
    rule: str
    k: int
    limit: int  # the undivided limit (requests at cost 1)
    shares: tuple[int, ...]  # per sub-bucket
    principal_max: int  # what one principal (with its sub-bucket's other principals) can take
    total_max: int  # the tenant total at most (= the undivided limit: no overshoot)
    total_min_busy: int  # the tenant total at least, with every sub-bucket busy

    @property
    def formula(self) -> str:
        return (f"tenant {self.tenant}, rule {self.rule}: {self.limit:,} split {self.k} ways "
                f"(shares {min(self.shares):,}..{max(self.shares):,}); one principal at most {self.principal_max:,}; "
                f"tenant total at most {self.total_max:,}, at least {self.total_min_busy:,} with every sub-bucket busy")


def _requests(rule: Rule) -> int:
    """What the rule admits at once, in requests at cost 1 (a bucket's burst, a window's limit)."""
    if "capacity_millis" in rule.__struct_fields__:
        return _int(rule, "capacity_millis") // (_int(rule, "cost_millis") or 1)
    return getattr(rule, "limit", 0) or 0


def split_shares(splits: Iterable[TenantSplit], rules: Iterable[Rule]) -> list[SplitShare]:
    rules = list(rules)
    out: list[SplitShare] = []
    for s in splits:
        k = s.sub_buckets
        for r in rules:
            if not _applies_to(r, s.tenant) or not is_divided(r) or r.pool_id is not None or r.shadow:
                continue
            limit = _requests(r)
            shares = tuple(_requests(divide(r, k, i)) for i in range(k))
            out.append(SplitShare(s.tenant, r.id, k, limit, shares, max(shares), limit, sum(shares)))
    return out


__all__ = ["MAX_SUB_BUCKETS", "MIN_SUB_BUCKETS", "SPLIT_SCOPES", "SplitShare", "TenantSplit", "divide", "divide_all",
           "is_divided", "principal_hash", "share", "split_problems", "split_shares", "splits_of", "sub_bucket"]
