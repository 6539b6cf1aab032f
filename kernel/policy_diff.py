"""Two bundles compared rule by rule and pool by pool: ``leasehold policy diff OLD NEW``. Pure.

Each difference is shown in the source's units (``rate 2/s -> 1/s``) and judged: *tightened*
(the new value admits less: a lower rate, burst, limit or concurrency cap, a higher cost, a
stricter fail mode or fallback, a rule now enforced that was a shadow, now revocable),
*loosened* (the opposite), or *changed* (no direction: which requests a rule selects — scope,
route group, tenant, algorithm —, timings such as decisionTtl). A rule is tightened or loosened
when all its judged differences go that way, *mixed* when they go both ways, and *changed* whatever
its numbers did when what it selects changed (it then limits other requests than before). The privileged
bypasses are reported by :mod:`kernel.bypass` as for ``policy validate --against``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .bundle import Bundle
from .bypass import FAIL_MODE_RANK, BypassChange, diff_bypasses
from .policy_source import pool_source, rate_parts, rule_source

TIGHTENED, LOOSENED, CHANGED, MIXED = "tightened", "loosened", "changed", "mixed"


@dataclass
class FieldChange:
    field: str
    old: Any
    new: Any
    verdict: str

    def line(self) -> str:
        return f"{self.field}: {_show(self.old)} -> {_show(self.new)} ({self.verdict})"


@dataclass
class ItemChange:
    kind: str  # rule | pool
    id: str
    change: str  # added | removed | tightened | loosened | mixed | changed
    fields: list[FieldChange] = field(default_factory=list)
    summary: str = ""


@dataclass
class BundleDiff:
    old_version: int
    new_version: int
    items: list[ItemChange]
    bypasses: list[BypassChange]

    @property
    def empty(self) -> bool:
        return not self.items and not self.bypasses


def _show(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {x}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def _per_ms(text: str) -> Fraction:
    amount, per = rate_parts(text)
    return Fraction(amount) / per


def _direction(higher_is_looser: bool, old: Any, new: Any) -> str:
    return LOOSENED if (new > old) == higher_is_looser else TIGHTENED


def _fallback_strength(fb: dict[str, Any] | None) -> tuple[Fraction, Fraction]:
    if fb is None:
        return Fraction(0), Fraction(0)
    if "rate" in fb:
        return _per_ms(fb["rate"]), Fraction(str(fb["burst"]))
    amount, per = rate_parts(fb["limit"])
    return Fraction(amount) / per, Fraction(amount)


def _judge(name: str, old: Any, new: Any) -> str:
    if name in ("rate",):
        return _direction(True, _per_ms(old), _per_ms(new))
    if name in ("burst", "chunkMax", "fallbackPerRegion"):
        return _direction(True, Fraction(str(old or 0)), Fraction(str(new or 0)))
    if name == "cost":
        return _direction(False, Fraction(str(old or 1)), Fraction(str(new or 1)))
    if name == "limit":
        (a0, p0), (a1, p1) = rate_parts(old), rate_parts(new)
        r0, r1 = Fraction(a0) / p0, Fraction(a1) / p1
        return _direction(True, r0, r1) if r0 != r1 else _direction(True, a0, a1)
    if name == "concurrency":
        if old is None or new is None:
            return LOOSENED if new is None else TIGHTENED
        return _direction(True, old, new)
    if name == "failMode":
        return _direction(True, FAIL_MODE_RANK.get(old, 2), FAIL_MODE_RANK.get(new, 2))
    if name == "fallback":
        (r0, b0), (r1, b1) = _fallback_strength(old), _fallback_strength(new)
        if r1 >= r0 and b1 >= b0:
            return LOOSENED
        return TIGHTENED if r1 <= r0 and b1 <= b0 else MIXED
    if name == "shadow":
        return LOOSENED if new else TIGHTENED
    if name == "revocable":
        return TIGHTENED if new else LOOSENED
    return CHANGED


# What a rule selects (which requests it limits) and the meaning of its numbers: once one of them
# changes, the rule limits other requests or counts otherwise, and its other fields' directions no
# longer say whether the old requests are limited more or less
SELECTION = ("scope", "routeGroup", "tenant", "algorithm")


def _compare(kind: str, old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any]) -> ItemChange | None:
    fields = []
    for name in dict.fromkeys([*old, *new]):
        a, b = old.get(name, defaults.get(name)), new.get(name, defaults.get(name))
        if a != b:
            fields.append(FieldChange(name, a, b, _judge(name, a, b)))
    if not fields:
        return None
    judged = {f.verdict for f in fields} - {CHANGED}
    change = MIXED if MIXED in judged or len(judged) > 1 else (judged.pop() if judged else CHANGED)
    moved = [f.field for f in fields if f.field in SELECTION] if kind == "rule" else []
    if moved:  # e.g. routeGroup read -> browse with a lower rate: the read requests are no longer limited by it
        return ItemChange(kind, old.get("id") or new.get("id", "?"), CHANGED, fields,
                          summary=f"{' and '.join(moved)} changed: it selects other requests or keys than before, "
                                  "so its numbers' directions say nothing about the requests it limited")
    return ItemChange(kind, old.get("id") or new.get("id", "?"), change, fields)


_RULE_DEFAULTS = {"cost": 1, "idempotent": False, "shadow": False, "revocable": False, "exempt": False}


def _summary(doc: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_show(v)}" for k, v in doc.items() if k != "id")


def diff(old: Bundle, new: Bundle) -> BundleDiff:
    old_rules = {r.id: rule_source(r) for r in old.rules}
    new_rules = {r.id: rule_source(r) for r in new.rules}
    items: list[ItemChange] = []
    for rid, doc in new_rules.items():
        if rid not in old_rules:
            items.append(ItemChange("rule", rid, "added", summary=_summary(doc)))
        elif (c := _compare("rule", old_rules[rid], doc, _RULE_DEFAULTS)) is not None:
            items.append(c)
    items += [ItemChange("rule", rid, "removed", summary=_summary(doc)) for rid, doc in old_rules.items()
              if rid not in new_rules]
    old_pools = {p.id: pool_source(p) for p in old.pools}
    new_pools = {p.id: pool_source(p) for p in new.pools}
    for pid, doc in new_pools.items():
        if pid not in old_pools:
            items.append(ItemChange("pool", pid, "added", summary=_summary(doc)))
        elif (c := _compare("pool", old_pools[pid], doc, {})) is not None:
            items.append(c)
    items += [ItemChange("pool", pid, "removed", summary=_summary(doc)) for pid, doc in old_pools.items()
              if pid not in new_pools]
    if old.max_age_ms != new.max_age_ms:
        items.append(ItemChange("bundle", "maxAge", CHANGED, [FieldChange("maxAgeMs", old.max_age_ms, new.max_age_ms,
                                                                          CHANGED)]))
    old_k = {t.tenant: t.sub_buckets for t in old.tenant_splits}
    new_k = {t.tenant: t.sub_buckets for t in new.tenant_splits}
    for tenant in sorted(old_k.keys() | new_k.keys()):  # a changed split moves the tenant's keys (kernel/split.py)
        if old_k.get(tenant, 1) != new_k.get(tenant, 1):
            items.append(ItemChange("bundle", f"tenantSplits {tenant}", CHANGED,
                                    [FieldChange("subBuckets", old_k.get(tenant, 1), new_k.get(tenant, 1), CHANGED)]))
    return BundleDiff(old.bundle_version, new.bundle_version, items, diff_bypasses(old, new))


def render(d: BundleDiff) -> list[str]:
    """The diff as text lines (what ``leasehold policy diff`` prints)."""
    out = [f"bundle {d.old_version} -> {d.new_version}"]
    if d.empty:
        return [*out, "no difference in rules, pools or bypasses"]
    for it in d.items:
        head = f"{it.kind} {it.id}: {it.change}"
        out.append(head + (f" ({it.summary})" if it.summary else ""))
        out += [f"    {f.line()}" for f in it.fields]
    if d.bypasses:
        out.append("privileged bypasses:")
        for c in d.bypasses:
            out.append("  " + c.line().replace("\n", "\n  "))
    return out


__all__ = ["CHANGED", "LOOSENED", "MIXED", "TIGHTENED", "BundleDiff", "FieldChange", "ItemChange", "diff", "render"]
