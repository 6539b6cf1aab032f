"""``leasehold policy explain``: what one request meets under a bundle — the rules that apply and
their order, their keys with the hash tag and the Redis Cluster slot, the one script call, and the
steps of the end-to-end trace (docs/invariants.md) for that request. It runs the agent's own plan
(:func:`region_agent.decision.plan.build_plan`) and key derivation; nothing is sent anywhere.

Principal hashes are keyed with a pepper: ``--pepper-file`` gives your deployment's (the keys
then equal the agents'); without it the public development pepper is used and the output says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis.crc import key_slot

from kernel.bundle import Bundle
from kernel.policy_source import rule_source
from region_agent.decision.keys import KeyBuilder, hash_tag
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.models import AdmitRequest, Principal


def _limits(rule: Any) -> str:
    doc = rule_source(rule)
    keep = ("rate", "burst", "limit", "pool", "cost", "concurrency", "failMode")
    return ", ".join(f"{k} {doc[k]}" for k in keep if k in doc)


def explain(bundle: Bundle, *, tenant: str | None, principal: str, principal_type: str, route: str,
            api_key: str | None = None, ip: str | None = None, cost: int = 1, pepper: bytes | None = None,
            request_id: str = "explain-0001") -> dict[str, Any]:
    """The explanation as a document (``--output json``); :func:`render` writes it as text."""
    dev = pepper is None
    keys = KeyBuilder(pepper or b"leasehold-insecure-dev-pepper")
    if principal_type == "anonymous":
        pid = ip or principal
    else:
        pid = principal
    req = AdmitRequest(request_id=request_id, principal=Principal(type=principal_type, id=pid, api_key_id=api_key),
                       route_group=route, tenant_id=tenant, cost_hint=cost)
    memo = Snapshot(bundle)
    plan = build_plan(memo, req, keys)
    shape = plan.shape
    rules = list(shape.rules) if shape is not None else list(plan.rules)
    slots = []
    for (slot, call) in zip(plan.slots, plan.calls, strict=True):
        slots.append({"rule": slot.rule.id, "role": slot.role.value, "kind": call.kind, "params": list(call.params),
                      "key": call.key, "hashTag": hash_tag(call.key), "slot": key_slot(call.key.encode())})
    shadow = [{"rule": s.rule.id, "kind": c.kind, "key": c.key} for s, c in zip(plan.shadow_slots, plan.shadow_calls,
                                                                                  strict=True)]
    fleet = [{"rule": g.rule.id, "pool": g.pool.id, "tokens": g.cost, "poolLimit": f"{g.pool.limit} per "
              f"{g.pool.window_ms} ms"} for g in plan.global_spends]
    approx = [{"rule": a.rule.id, "key": a.key, "hashTag": hash_tag(a.key), "slot": key_slot(a.key.encode()),
               "reconcileMs": a.rule.approximate.reconcile_ms if a.rule.approximate else 0,
               "localMax": a.rule.approximate.local_max if a.rule.approximate else 0} for a in plan.approx]
    tags = sorted({s["hashTag"] for s in slots})
    return {
        "bundleVersion": bundle.bundle_version,
        "request": {"tenant": tenant, "principalType": principal_type, "routeGroup": route, "apiKey": bool(api_key),
                    "cost": cost},
        "devPepper": dev,
        "rules": [{"id": r.id, "scope": r.scope, "algorithm": r.algorithm, "routeGroup": r.route_key,
                   "tenant": r.tenant, "shadow": r.shadow, "exempt": r.exempt, "limits": _limits(r),
                   "fleetWide": r.fleet_wide,
                   "limit": r.limit_tokens(memo.pools), "windowMs": r.policy_window_ms(memo.pools)} for r in rules],
        "fleetWide": fleet,
        "call": {"slots": slots, "decisionKey": plan.decision_key, "decisionTtlMs": plan.decision_ttl_ms,
                 "hashTags": tags, "sameSlot": len({s["slot"] for s in slots}) <= 1},
        "shadow": shadow,
        "approximate": approx,
    }


def render(doc: dict[str, Any], bundle: Bundle) -> list[str]:
    r = doc["request"]
    rules = doc["rules"]
    call = doc["call"]
    out = [f"bundle {doc['bundleVersion']}: a {r['principalType']} request of tenant {r['tenant'] or '-'} on route "
           f"group {r['routeGroup']} (cost {r['cost']}{', with an API key' if r['apiKey'] else ''})", ""]
    if not rules:
        out.append("no rule applies: every such request is admitted without a store call")
    else:
        out.append("rules that apply, in evaluation order (the first denying one is reported):")
        for i, rule in enumerate(rules, 1):
            flags = [f for f, on in (("shadow: counted, never enforced", rule["shadow"]),
                                     ("exempt: a capped bypass", rule["exempt"]),
                                     ("fleet-wide: spent from in-process chunks", rule["fleetWide"])) if on]
            out.append(f"  {i}. {rule['id']} ({rule['scope']} scope, {rule['algorithm']}, route group "
                       f"{rule['routeGroup']}): {rule['limits']}" + (f"  [{'; '.join(flags)}]" if flags else ""))
    out.append("")
    out.append("trace (docs/invariants.md, end-to-end request):")
    step = 0

    def s(text: str) -> None:
        nonlocal step
        step += 1
        out.append(f"  {step}. {text}")

    ip_rules = [x for x in rules if x["scope"] == "ip"]
    s("edge, pre-authentication: " + ("the caller's address is counted by " + ", ".join(x["id"] for x in ip_rules)
                                       if ip_rules else "no ip rule applies to this request"))
    s(f"policy lookup: bundle {doc['bundleVersion']}, {len(rules)} rule(s); policyVersion "
      f"{doc['bundleVersion']} is written into the decision")
    if doc["fleetWide"]:
        for g in doc["fleetWide"]:
            s(f"fleet-wide pool {g['pool']} ({g['poolLimit']}): {g['tokens']} token(s) from this agent's leased "
              f"chunk, no store call (rule {g['rule']})")
    for a in doc["approximate"]:
        s(f"approximate rule {a['rule']}: counted in this agent process, no store call per request; "
          f"reconciled every {a['reconcileMs']} ms with {a['key']} (tag {{{a['hashTag']}}} slot {a['slot']}), "
          f"at most {a['localMax']} unseen unit(s) per agent")
    if call["slots"]:
        s("key derivation: principal parts are keyed hashes" + (" (development pepper: give --pepper-file for "
                                                                "your deployment's keys)" if doc["devPepper"] else ""))
        for sl in call["slots"]:
            out.append(f"       {sl['key']}  tag {{{sl['hashTag']}}} slot {sl['slot']}  ({sl['rule']}, {sl['role']})")
        same = "one hash slot: one atomic script on one shard" if call["sameSlot"] else \
            "MORE THAN ONE hash slot: the call would be refused (CROSSSLOT)"
        s(f"atomic decision: one multi_rule.lua call, {len(call['slots'])} slot(s), {same}")
        for sl in call["slots"]:
            out.append(f"       {sl['kind']} {sl['params']}  ({sl['rule']})")
        if call["decisionTtlMs"]:
            s(f"idempotent: the decision is recorded under the request id for {call['decisionTtlMs']} ms; a retry "
              "after an ambiguous timeout replays it instead of debiting twice")
    elif not doc["fleetWide"]:
        s("no store call")
    anonymous = r["principalType"] == "anonymous"
    if rules:
        s("denied: 429 with Retry-After = ceil(retryAfterMs / 1000) s" +
          (", a generic problem (anonymous callers see no policy names)" if anonymous else
           ", RateLimit / RateLimit-Policy for the caller's own scope (user, key)"))
    else:
        s("admitted: no rule can deny this request")
    for rule in rules:
        rr = next(x for x in bundle.rules if x.id == rule["id"])
        if rr.fail_mode == "closed":
            what = f"503 (fails closed, Retry-After {rr.closed_retry_after_ms} ms)"
        elif rr.fail_mode == "open":
            what = "admitted unmetered (fails open)"
        elif rr.approximate is not None:
            what = f"its in-process counter, at most {rr.approximate.local_max} unit(s) beyond its last reading"
        elif rr.fallback is not None:
            what = "the local fallback " + _limits_of_fallback(rr)
        else:
            what = "the pool's fallbackPerRegion allowance"
        s(f"store unreachable, {rule['id']}: {what}" + ("" if rr.approximate is not None
                                                           else "; fallback: true in the decision"))
    if doc["shadow"]:
        s("shadow rules evaluated in a separate call: " + ", ".join(x["rule"] for x in doc["shadow"]))
    return out


def _limits_of_fallback(rule: Any) -> str:
    fb = rule_source(rule).get("fallback", {})
    return "(" + ", ".join(f"{k} {v}" for k, v in fb.items()) + ", per agent)"


def read_pepper(path: str | None) -> bytes | None:
    if not path:
        return None
    data = Path(path).read_bytes().strip()
    if not data:
        raise ValueError(f"{path} is empty")
    return data


__all__ = ["explain", "read_pepper", "render"]
