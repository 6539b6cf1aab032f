"""The versioned policy bundle: rules for regional admission, pools for
global quotas. One format for both services; validated by the same code everywhere
(agent start, allocator start, ``leasehold policy validate``/``publish``).

Units: token buckets and GCRA in millitokens and milliseconds; window algorithms in whole
requests per ``windowMs``; pools in whole tokens per ``windowMs``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from .algorithms import ALGORITHMS, Fallback, LocalModel, Role, RuleBase, RuleUnion, make_rule
from .algorithms.rule import NonNegInt, PosInt
from .approx import approximate_problems
from .errors import PolicyError
from .ids import KEY_ID_RE, OWNER_RE, POOL_ID_RE, REGION_RE, ROUTE_RE, RULE_ID_RE, SIGNATURE_RE, TENANT_RE
from .split import TenantSplit, split_problems

MAX_RULES_PER_REQUEST = 8

Rule = RuleBase  # a bundle rule: one Struct per algorithm (kernel.algorithms), tagged by "algorithm"

# Evaluation (and reporting) order: most specific, least sensitive first.
SCOPE_ORDER: dict[str, int] = {"ip": 0, "user": 1, "key": 2, "route": 3, "tenant": 4, "global": 5}

# The format's rule was once one flat object carrying every algorithm's fields; bundles written
# then (every sample, every bundle `encode_bundle` wrote) list all of them, with these values
# when the algorithm does not use them. They are accepted at those values, written back in the
# same order, and covered by the checksum and the signature as they were: existing sealed and
# signed bundles keep verifying (tests/unit/kernel/test_bundle_wire.py).
FLAT_RULE_FIELDS: dict[str, object] = {
    "capacityMillis": None, "refillMillis": None, "periodMs": None, "costMillis": None,
    "limit": None, "windowMs": None, "pool": None, "cost": 1,
}
FLAT_RULE_ORDER = ("id", "scope", "algorithm", "failMode", "routeGroup", "tenant", "capacityMillis", "refillMillis",
                   "periodMs", "costMillis", "limit", "windowMs", "pool", "cost", "concurrencyMax",
                   "concurrencyTtlMs", "concurrencyRetryAfterMs", "idempotent", "decisionTtlMs", "ttlSlackMs",
                   "closedRetryAfterMs", "fallback", "shadow", "revocable", "ipv4Prefix", "ipv6Prefix", "exempt",
                   "owner")


class Pool(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    """A global quota: ``limit`` tokens per ``windowMs`` across all regions."""

    id: str
    window_ms: Annotated[int, Meta(ge=1_000, le=86_400_000)]
    limit: PosInt
    lease_ttl_ms: Annotated[int, Meta(ge=100, le=3_600_000)] = 15_000
    chunk_min: PosInt = 1
    chunk_max: PosInt = 100
    fallback_per_region: NonNegInt = 0  # tokens a region may admit per window with the allocator unreachable
    prefetch_ms: NonNegInt = 2_000  # a region may ask for window k+1 this long before it starts
    active_horizon_ms: PosInt = 10_000  # regions that asked this recently share the tail fairly
    chunk_validity_ms: Annotated[int, Meta(ge=10, le=60_000)] = 250  # gateway-side chunks (global scope)
    regions: list[str] | None = None  # regions allowed to lease; None = any


class Bundle(Struct, rename="camel", forbid_unknown_fields=True, frozen=True):
    bundle_version: PosInt
    published_at: str
    checksum: str
    rules: list[RuleUnion]
    pools: list[Pool] = []
    max_age_ms: PosInt | None = None  # snapshot freshness for revocable rules (I13)
    # Ed25519 signature (kernel/signing.py): keyId names the public key, signature is
    # "ed25519:<base64>" over signing.signed_message(bundle); both absent on an unsigned bundle
    key_id: str | None = None
    signature: str | None = None
    # very large tenants spread over k hash tags (kernel/split.py); written (and covered by the
    # checksum and the signature) only when present, so existing bundles keep their checksums
    tenant_splits: list[TenantSplit] = []


# Rule fields added after bundles were sealed and signed: written (and covered by the checksum)
# only when not at their default, so every existing bundle keeps its bytes and its checksum.
OPTIONAL_RULE_FIELDS: dict[str, object] = {"everyRequest": False, "hotChunk": None, "approximate": None}


# --------------------------------------------------------------------------------------------
def rule_doc(rule: Rule) -> dict[str, Any]:
    """A rule as the format writes it: every field (defaults included) in the flat order, the
    unused fields of the flat format at their values (:data:`FLAT_RULE_FIELDS`), then any field
    an algorithm added since."""
    own = msgspec.to_builtins(rule)
    doc = {k: own.pop(k) if k in own else FLAT_RULE_FIELDS[k] for k in FLAT_RULE_ORDER}
    for k, default in OPTIONAL_RULE_FIELDS.items():
        if own.get(k, default) == default:
            own.pop(k, None)
    doc.update(own)
    return doc


def canonical_payload(rules: Iterable[Rule], pools: Iterable[Pool], max_age_ms: int | None = None,
                      tenant_splits: Iterable[TenantSplit] = ()) -> bytes:
    """Canonical encoding the checksum covers: every field (defaults included), sorted keys;
    ``tenantSplits`` only when there are any."""
    doc: dict[str, Any] = {
        "rules": [rule_doc(r) for r in rules],
        "pools": [msgspec.to_builtins(p) for p in pools],
        "maxAgeMs": max_age_ms,
    }
    splits = [msgspec.to_builtins(s) for s in tenant_splits]
    if splits:
        doc["tenantSplits"] = splits
    return msgspec.json.encode(doc, order="sorted")


def compute_checksum(rules: Iterable[Rule], pools: Iterable[Pool], max_age_ms: int | None = None,
                     tenant_splits: Iterable[TenantSplit] = ()) -> str:
    return "sha256:" + hashlib.sha256(canonical_payload(rules, pools, max_age_ms, tenant_splits)).hexdigest()


def seal(bundle: Bundle) -> Bundle:
    """Return the bundle with its checksum filled in (used by tooling that writes bundles).

    Sealing means the content may have changed, so any signature is dropped: sign after
    sealing (``kernel.signing.sign_bundle``)."""
    return msgspec.structs.replace(
        bundle, checksum=compute_checksum(bundle.rules, bundle.pools, bundle.max_age_ms, bundle.tenant_splits),
        key_id=None, signature=None,
    )


def _unflatten(doc: Any) -> list[str]:
    """Drop the flat format's unused fields from each rule object of a decoded bundle document
    (in place); a value other than the flat default is a problem (the algorithm has no such field)."""
    problems: list[str] = []
    rules = doc.get("rules") if isinstance(doc, dict) else None
    for r in rules if isinstance(rules, list) else []:
        cls = ALGORITHMS.get(str(r.get("algorithm"))) if isinstance(r, dict) else None
        if cls is None:
            continue  # the schema check names it
        own = cls.__struct_encode_fields__
        for k, default in FLAT_RULE_FIELDS.items():
            if k in r and k not in own:
                v = r.pop(k)
                if v is not default and not (type(v) is type(default) and v == default):
                    problems.append(f"rule {r.get('id')!r}: {k} does not apply to algorithm {cls.algorithm}")
    return problems


# msgspec decodes nested arrays and objects recursively: a value nested about a thousand levels deep
# (a few kilobytes of brackets) raises RecursionError, which is no PolicyError; a bundle nests five
NESTED_TOO_DEEPLY = "bundle is not valid JSON: nested too deeply (a bundle nests arrays and objects a few levels)"


def repeated_key(raw: bytes | str) -> str | None:
    """The first key that one object of the JSON ``raw`` repeats (None: none does). A decoder keeps
    the last value, a reader of the file may see the first: a bundle says each key once."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            found.append(next(k for i, k in enumerate(keys) if k in keys[:i]))
        return dict(items)

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except RecursionError:
        raise PolicyError(NESTED_TOO_DEEPLY) from None
    except ValueError:
        return None  # msgspec's decode, which accepted it, is the judge of JSON
    return found[0] if found else None


def refuse_repeated_keys(raw: bytes | str) -> None:
    """Raise PolicyError when one object of ``raw`` repeats a key (:func:`repeated_key`)."""
    if (key := repeated_key(raw)) is not None:
        raise PolicyError(f"bundle repeats the key {key!r} in one object: the services would take its last value, "
                          "a reader of the file may see the first; a bundle says each key once")


def decode_schema(raw: bytes | str) -> tuple[Bundle, list[str]]:
    """``raw`` (JSON) decoded into the schema, nothing more: the bundle and the problems found while
    decoding (a flat-format field at a value its algorithm has no use for), for :func:`validate_bundle`
    to report with the rest. Raises PolicyError when ``raw`` is no JSON or does not match the schema.
    Its cost is linear in the bytes; a signature can be verified on what it returns
    (``kernel.signing.TrustedKeys.check``), none of the checks of :func:`validate_bundle` has run."""
    try:
        doc = msgspec.json.decode(raw)
        flat = _unflatten(doc)
        return msgspec.convert(doc, type=Bundle), flat
    except msgspec.ValidationError as e:
        raise PolicyError(f"bundle does not match the schema: {e}", errors=[str(e)]) from None
    except msgspec.DecodeError as e:
        if (raw.encode() if isinstance(raw, str) else raw).startswith(b"\xef\xbb\xbf"):
            raise PolicyError("bundle is not valid JSON: it starts with a UTF-8 byte order mark (an editor's); "
                              "save it without one") from None
        raise PolicyError(f"bundle is not valid JSON: {e}", errors=[str(e)]) from None
    except RecursionError:
        raise PolicyError(NESTED_TOO_DEEPLY) from None


def decode_bundle(raw: bytes | str, *, verify: Callable[[Bundle], None] | None = None) -> Bundle:
    """Decode and fully validate a bundle (JSON). Raises PolicyError listing every problem.

    ``verify`` (a service's ``TrustedKeys.check``) runs on the bundle as decoded into the schema,
    before anything else is checked: a bundle it refuses (``SignatureRefused``) costs a decode and
    one Ed25519 verification, never the repeated-key parse, the checksum or :func:`validate_bundle`
    (docs/decisions/0079)."""
    bundle, flat = decode_schema(raw)
    if verify is not None:
        verify(bundle)
    refuse_repeated_keys(raw)
    validate_bundle(bundle, flat)
    return bundle


SOURCE_SUFFIXES = (".yaml", ".yml")  # a policy source (kernel/policy_yaml.py), never a sealed bundle


def read_bundle_bytes(path: str) -> bytes:
    """The bytes of the sealed bundle (JSON) at ``path``. A policy source given instead is refused
    by name (``leasehold policy compile`` makes the bundle of it) rather than decoded as JSON."""
    if str(path).endswith(SOURCE_SUFFIXES):
        raise PolicyError(f"{str(path)!r} is a policy source (YAML), not a sealed bundle (JSON): compile it "
                          f"first with `leasehold policy compile {path}`")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PolicyError(f"cannot read policy bundle {str(path)!r}: {e.strerror}") from None


def load_bundle_file(path: str, *, verify: Callable[[Bundle], None] | None = None) -> Bundle:
    """The sealed bundle (JSON) at ``path``, decoded, verified by ``verify`` first (:func:`decode_bundle`)
    and validated (:func:`read_bundle_bytes`)."""
    return decode_bundle(read_bundle_bytes(path), verify=verify)


def encode_bundle(bundle: Bundle) -> bytes:
    """Pretty JSON; an unsigned bundle carries no ``keyId``/``signature`` keys at all."""
    doc = msgspec.to_builtins(bundle)
    doc["rules"] = [rule_doc(r) for r in bundle.rules]
    for k in ("keyId", "signature"):
        if doc.get(k) is None:
            doc.pop(k, None)
    if not doc.get("tenantSplits"):
        doc.pop("tenantSplits", None)
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


# --------------------------------------------------------------------------------------------
def rule_applies(rule: Rule, *, tenant: str | None, route_group: str, principal_type: str, has_key: bool) -> bool:
    """Does ``rule`` apply to a request with these attributes (before override resolution)?"""
    if rule.route_group is not None and rule.route_group != route_group:
        return False
    if principal_type == "anonymous":
        return rule.scope == "ip"
    if rule.scope == "ip":
        return False
    if rule.tenant is not None and rule.tenant != tenant:
        return False
    if rule.scope == "user":
        return principal_type == "user"
    if rule.scope == "key":
        return has_key
    return True  # route, tenant, global


def every_request_rules(rules: Iterable[Rule], *, route_group: str) -> list[Rule]:
    """The pre-authentication stage an authenticated request also spends: the ip rules marked
    ``everyRequest`` that an anonymous request on ``route_group`` selects."""
    return [r for r in select_rules(rules, tenant=None, route_group=route_group, principal_type="anonymous",
                                    has_key=False) if r.every_request]


def select_rules(
    rules: Iterable[Rule], *, tenant: str | None, route_group: str, principal_type: str, has_key: bool
) -> list[Rule]:
    """The rules one request is evaluated against, in evaluation order.

    A tenant-specific rule overrides a generic one with the same (scope, routeGroup) — that
    pair names one key, so a request never lists the same key twice. An exempt rule for the
    tenant replaces every other non-ip rule by its own cap (a capped bypass, I14).
    """
    chosen: dict[tuple[str, str], Rule] = {}
    for r in rules:
        if not rule_applies(r, tenant=tenant, route_group=route_group, principal_type=principal_type, has_key=has_key):
            continue
        ident = (r.scope, r.route_key)
        prev = chosen.get(ident)
        if prev is None or (prev.tenant is None and r.tenant is not None):
            chosen[ident] = r
    selected = list(chosen.values())
    exempt = [r for r in selected if r.exempt]
    if exempt:
        selected = exempt
    # most specific first within a scope: a route-specific rule before an "all" rule
    selected.sort(key=lambda r: (SCOPE_ORDER[r.scope], r.route_group is None))
    return selected


# --------------------------------------------------------------------------------------------
def hot_chunk_problems(r: Rule) -> list[str]:
    """What keeps a rule's ``hotChunk`` from being honoured (region_agent.leasing.hot_chunks)."""
    if r.hot_chunk is None:
        return []
    out = []
    if r.scope in ("ip", "global"):
        out.append("hotChunk needs a tenant-tagged scope (user, key, route, tenant)")
    if r.concurrency_max is not None:
        out.append("hotChunk cannot serve a concurrency gate (a slot is per request)")
    if r.idempotent:
        out.append("hotChunk cannot keep an idempotent rule's decision records (a chunk admits without the store)")
    if r.shadow:
        out.append("hotChunk is for enforced rules")
    if r.approximate is not None:
        out.append("hotChunk and approximate exclude each other (an approximate rule already admits without a "
                   "store call)")
    return out


def _rule_problems(r: Rule, pools: dict[str, Pool]) -> list[str]:
    p: list[str] = []
    name = f"rule {r.id!r}"
    if not RULE_ID_RE.fullmatch(r.id):
        p.append(f"{name}: id must match {RULE_ID_RE.pattern}")
    if r.fail_mode is None:
        p.append(f"{name}: failMode is required (one of local_bounded, closed, open)")
    if r.route_group is not None and not ROUTE_RE.fullmatch(r.route_group):
        p.append(f"{name}: routeGroup must match {ROUTE_RE.pattern}")
    if r.tenant is not None and not TENANT_RE.fullmatch(r.tenant):
        p.append(f"{name}: tenant must match {TENANT_RE.pattern}")
    if r.scope == "ip" and r.tenant is not None:
        p.append(f"{name}: ip-scoped rules are pre-authentication and cannot name a tenant")
    if r.every_request and r.scope != "ip":
        p.append(f"{name}: everyRequest is for ip-scoped rules (the pre-authentication stage of every request)")
    if r.every_request and r.concurrency_max is not None:
        p.append(f"{name}: an everyRequest rule carries no concurrency gate")
    p.extend(f"{name}: {problem}" for problem in hot_chunk_problems(r))
    p.extend(f"{name}: {problem}" for problem in r.problems(pools))  # the algorithm's own
    if r.scope == "global" and r.role is not Role.POOL:
        p.append(f"{name}: global scope needs algorithm pool: a direct global key would cross hash slots "
                 "with the tenant's keys (spend it from a leased chunk instead)")
    if r.concurrency_max is not None and r.scope in ("global", "ip"):
        p.append(f"{name}: concurrencyMax needs a tenant-tagged scope (user, key, route, tenant)")
    p.extend(f"{name}: {problem}" for problem in approximate_problems(r))
    if r.fail_mode == "local_bounded" and r.local_model is LocalModel.FALLBACK and r.approximate is None:
        # (pools degrade through the pool's fallbackPerRegion instead)
        if r.fallback is None:
            p.append(f"{name}: failMode local_bounded needs fallback parameters "
                     "(capacityMillis/refillMillis/periodMs or limit/windowMs)")
        else:
            p.extend(f"{name}: {problem}" for problem in r.fallback.problems())
    if r.exempt:  # a privileged bypass (I14): narrow, capped, owned, audited
        if not r.owner:
            p.append(f"{name}: an exempt rule needs an owner")
        elif not OWNER_RE.fullmatch(r.owner):
            p.append(f"{name}: owner must match {OWNER_RE.pattern} (it is written into every audit event)")
        if r.tenant is None:
            p.append(f"{name}: an exempt rule must name a tenant (a catch-all bypass is rejected)")
        if r.fail_mode == "open":
            p.append(f"{name}: an exempt rule cannot fail open (with the store unreachable the bypass would "
                     "be unmetered, a flood channel); use closed or local_bounded")
        if r.shadow:
            p.append(f"{name}: an exempt rule cannot be a shadow rule (it would replace the tenant's rules by "
                     "one that is never enforced)")
    elif r.owner is not None and not OWNER_RE.fullmatch(r.owner):
        p.append(f"{name}: owner must match {OWNER_RE.pattern}")
    return p


def _pool_problems(pool: Pool) -> list[str]:
    p: list[str] = []
    name = f"pool {pool.id!r}"
    if not POOL_ID_RE.fullmatch(pool.id):
        p.append(f"{name}: id must match {POOL_ID_RE.pattern}")
    if pool.chunk_min > pool.chunk_max:
        p.append(f"{name}: chunkMin {pool.chunk_min} exceeds chunkMax {pool.chunk_max}")
    if pool.chunk_max > pool.limit:
        p.append(f"{name}: chunkMax {pool.chunk_max} exceeds the pool limit {pool.limit}")
    if pool.prefetch_ms >= pool.window_ms:
        p.append(f"{name}: prefetchMs must be shorter than windowMs")
    for region in pool.regions or []:
        if not REGION_RE.fullmatch(region):
            p.append(f"{name}: region {region!r} must match {REGION_RE.pattern}")
    return p


def validate_bundle(bundle: Bundle, problems: list[str] | None = None) -> None:
    """Everything bundle validation must catch (docs/invariants.md I13), plus checksum verification. ``problems``:
    found before (while decoding), reported with the rest."""
    problems = list(problems or [])
    if not bundle.checksum.startswith("sha256:"):
        problems.append("checksum must be 'sha256:<hex>' over the canonical rules and pools")
    else:
        expect = compute_checksum(bundle.rules, bundle.pools, bundle.max_age_ms, bundle.tenant_splits)
        if expect != bundle.checksum:
            problems.append(f"checksum mismatch: bundle says {bundle.checksum}, content hashes to {expect}")
    if (bundle.key_id is None) != (bundle.signature is None):
        problems.append("keyId and signature go together: a signed bundle carries both, an unsigned one neither")
    elif bundle.key_id is not None:
        if not KEY_ID_RE.fullmatch(bundle.key_id):
            problems.append(f"keyId must match {KEY_ID_RE.pattern} (the first 16 hex digits of the sha256 "
                            "of the raw Ed25519 public key)")
        if not SIGNATURE_RE.fullmatch(bundle.signature or ""):
            problems.append("signature must be 'ed25519:<base64 of 64 bytes>'")
    pools: dict[str, Pool] = {}
    for pool in bundle.pools:
        if pool.id in pools:
            problems.append(f"pool {pool.id!r} is defined twice")
        pools[pool.id] = pool
        problems.extend(_pool_problems(pool))
    seen_ids: set[str] = set()
    idents: dict[tuple[str, str, str | None], str] = {}
    for r in bundle.rules:
        if r.id in seen_ids:
            problems.append(f"rule id {r.id!r} is used twice")
        seen_ids.add(r.id)
        problems.extend(_rule_problems(r, pools))
        ident = (r.scope, r.route_key, r.tenant)
        if ident in idents:
            problems.append(f"rules {idents[ident]!r} and {r.id!r} name the same key "
                            f"(scope {r.scope}, routeGroup {r.route_key}, tenant {r.tenant or '*'})")
        else:
            idents[ident] = r.id
    problems.extend(_pool_balance_problems(bundle.rules))
    problems.extend(split_problems(bundle.tenant_splits, bundle.rules, pools))
    if not problems:
        problems.extend(_request_set_problems(bundle.rules))
    if problems:
        raise PolicyError(f"policy bundle {bundle.bundle_version} is invalid: {problems[0]}"
                          + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), errors=problems)


def script_slots(selected: list[Rule]) -> int:
    """Script calls one request's rule set takes: one per enforced rule, plus one per
    concurrency gate (shadow rules run in their own call)."""
    enforced = [r for r in selected if not r.shadow]
    return len(enforced) + sum(1 for r in enforced if r.concurrency_max is not None)


def _pool_balance_problems(rules: list[Rule]) -> list[str]:
    """Every pool is spent from one balance per region: the fleet-wide ``{g:<pool>}`` balance
    (global-scope rules) or the balance of the one tenant its rules name. The overshoot bound
    counts one fallback allowance per pool and region: a pool spent by a generic (any-tenant)
    rule, or by rules of several tenants or of both kinds, would have one balance and one
    allowance per tenant or kind."""
    kinds: dict[str, set[str]] = {}
    for r in rules:
        if r.pool_id is not None and not r.shadow:
            kinds.setdefault(r.pool_id, set()).add("global" if r.scope == "global" else f"tenant {r.tenant or '*'}")
    out = []
    for pool, seen in sorted(kinds.items()):
        if len(seen) > 1 or "tenant *" in seen:
            out.append(f"pool {pool!r} is spent from more than one balance per region ({', '.join(sorted(seen))}): "
                       "pool rules of one pool must all be global-scope or all name the same tenant")
    return out


# Every (tenant named by a rule, route group named by a rule) pair is one request set to check: a
# bundle naming thousands of each (a few hundred kilobytes) would take hours to check, on every
# agent that reads it. Below the cap it still takes up to about a second: a service that trusts
# keys verifies the signature before this check (decode_bundle's verify, docs/decisions/0079)
MAX_REQUEST_SETS = 100_000


def _request_set_problems(rules: list[Rule]) -> list[str]:
    """Every request's rule set is a handful long and maps to one hash tag."""
    tenants: list[str | None] = sorted({r.tenant for r in rules if r.tenant}) + [None]
    routes = sorted({r.route_group for r in rules if r.route_group}) + ["\x00other"]
    if len(tenants) * len(routes) > MAX_REQUEST_SETS:
        return [f"the rules name {len(tenants) - 1} tenants and {len(routes) - 1} route groups: "
                f"{len(tenants) * len(routes):,} combinations of a request's rule set to check, more than "
                f"{MAX_REQUEST_SETS:,}: rules name fewer tenants or route groups"]
    # a request of (tenant, route) selects from the rules naming that tenant or none and that route
    # group or none: four buckets, in the bundle's order, instead of every rule for every pair
    by_key: dict[tuple[str | None, str | None], list[tuple[int, Rule]]] = {}
    for i, r in enumerate(rules):
        by_key.setdefault((r.tenant, r.route_group), []).append((i, r))
    problems: list[str] = []
    for tenant in tenants:
        for route in routes:
            keys = {(None, None), (tenant, None), (None, route), (tenant, route)}
            near = [r for _, r in sorted((x for k in keys for x in by_key.get(k, ())), key=lambda x: x[0])]
            for ptype, has_key in (("user", True), ("user", False), ("service", True), ("anonymous", False)):
                sel = select_rules(near, tenant=tenant or "\x00any", route_group=route,
                                   principal_type=ptype, has_key=has_key)
                pools = [r.pool_id for r in sel if r.pool_id is not None and not r.shadow]
                for pool in sorted({p for p in pools if pools.count(p) > 1}):
                    problems.append(
                        f"a {ptype} request of tenant {tenant or '*'} on route {route.strip(chr(0))} spends pool "
                        f"{pool!r} through more than one rule ({', '.join(r.id for r in sel if r.pool_id == pool)}): "
                        "the same balance twice in one script")
                slots = script_slots(sel)
                if slots > MAX_RULES_PER_REQUEST:
                    problems.append(
                        f"a {ptype} request of tenant {tenant or '*'} on route {route.strip(chr(0))} needs "
                        f"{slots} script slots for {len(sel)} rules (a concurrency gate takes one more; "
                        f"at most {MAX_RULES_PER_REQUEST})")
    return sorted(set(problems))


__all__ = ["ALGORITHMS", "MAX_REQUEST_SETS", "MAX_RULES_PER_REQUEST", "NESTED_TOO_DEEPLY", "SCOPE_ORDER", "Bundle",
           "Fallback", "NonNegInt", "Pool", "PosInt", "Rule", "SOURCE_SUFFIXES", "canonical_payload",
           "compute_checksum", "decode_bundle", "decode_schema", "encode_bundle", "every_request_rules",
           "load_bundle_file", "make_rule", "read_bundle_bytes", "refuse_repeated_keys", "repeated_key", "rule_applies",
           "rule_doc", "script_slots", "seal", "select_rules", "validate_bundle"]
