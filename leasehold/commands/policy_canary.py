"""``leasehold policy canary|promote|rollback|status``: a staged release through etcd
(docs/policy.md, "Canary release"). The store side is :class:`kernel.policy_store.PolicyStore`
(``stage``, ``promote``, ``rollback``); the agents' side is ``region_agent.service.policy.PolicyHolder``.

``status`` reads the published and the staged bundle from etcd and every agent's
``/metrics``, and prints per version — the candidate's (the canary) and the published one's
(the rest) — the decisions, the denial and fallback rates and each rule's denial rate (the
decisions it denied over all the decisions of that version; for a tenant slice, of the slice's
tenants only, so like is compared with like). It exits 8 when a rule's denial rate under the
candidate exceeds the published one's by more than ``--margin``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import defaultdict
from typing import Any

import httpx

from kernel.bundle import Bundle, encode_bundle
from kernel.errors import LeaseholdError, NotFound, PolicyError, StoreUnavailable
from kernel.ids import NODE_ID, REGION, TENANT_ID
from kernel.policy_store import Slice, rollback_bundle
from kernel.policy_yaml import load_policy

from .argtypes import http_url, names
from .policy_cli import EXIT_CANARY_WORSE, EXIT_OK, EXIT_USAGE, emit, fail, now_text

EXIT_UNAVAILABLE, EXIT_CONNECT = 4, 5
DENIED = ("denied", "fallback_denied")
FALLBACK = ("fallback_allowed", "fallback_denied")


def _cli() -> Any:
    from . import cli
    return cli


def _sign(args: argparse.Namespace, bundle: Bundle) -> Bundle:
    """Signed with ``--key``, LEASEHOLD_POLICY_SIGNING_KEY, or the running local topology's key
    (an already signed bundle keeps its signature)."""
    import os

    from kernel.signing import load_private_key, sign_bundle
    key = getattr(args, "key", None) or os.environ.get("LEASEHOLD_POLICY_SIGNING_KEY")
    if not key and bundle.signature is None:
        key = _cli()._topology_signing_key(args)
    return sign_bundle(bundle, load_private_key(key)) if key else bundle


async def _run(args: argparse.Namespace, op) -> tuple[int, Any]:
    store = _cli()._policy_store(args)
    try:
        return EXIT_OK, await op(store)
    finally:
        await store.store.close()


def _call(args: argparse.Namespace, op) -> tuple[int, Any]:
    try:
        return asyncio.run(_run(args, op))
    except PolicyError as e:
        return fail(args, e), None
    except NotFound as e:  # nothing to promote or roll back: not an invalid bundle
        return fail(args, f"not done: {e.detail}"), None
    except StoreUnavailable as e:
        return fail(args, f"not done: cannot reach etcd ({e.detail})", EXIT_CONNECT), None
    except LeaseholdError as e:
        return fail(args, f"not done ({e.code}): {e.detail}", EXIT_UNAVAILABLE if e.retriable else 3), None


# ------------------------------------------------------------------------------ canary, promote, rollback
def cmd_canary(args: argparse.Namespace) -> int:
    sl = Slice(regions=args.regions or [], agents=args.agents or [], tenants=args.tenants or [])
    try:
        bundle = _sign(args, load_policy(args.file))
    except PolicyError as e:
        return fail(args, e)
    raw = encode_bundle(bundle)
    code, res = _call(args, lambda store: store.stage(raw, sl))
    if res is None:
        return code
    emit(args, {"staged": res.version, "current": res.previous, "slice": {"regions": sl.regions, "agents": sl.agents,
                                                                            "tenants": sl.tenants},
                "revision": res.revision, "keyId": bundle.key_id},
         [f"staged bundle {res.version} for {sl.text()} (the rest keeps {res.previous}); watch it with "
          "`leasehold policy status`, finish with `leasehold policy promote` or `rollback`"])
    return EXIT_OK


def cmd_promote(args: argparse.Namespace) -> int:
    code, res = _call(args, lambda store: store.promote())
    if res is None:
        return code
    emit(args, {"published": res.version, "previous": res.previous, "revision": res.revision},
         [f"promoted: bundle {res.version} is published to every agent (was {res.previous})"])
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace) -> int:
    """The published content under a version above the candidate's, signed again (the signature covers
    the version), written with the canary's removal in one transaction."""
    async def op(store):
        current, staged = await store.read_both()
        if staged is None:
            raise NotFound("no canary is staged (to roll a published bundle back, publish its content under "
                              "a new version: policy publish OLD --as-version N)")
        if current is None or current.bundle is None:
            raise PolicyError("the published bundle is unreadable; publish a valid one")
        top = max(current.bundle.bundle_version, staged.bundle.bundle_version if staged.bundle else 0,
                  await store.read_published_version() or 0)
        back = _sign(args, rollback_bundle(current.bundle, args.as_version or top + 1,
                                           args.published_at or now_text()))
        return await store.rollback(encode_bundle(back)), back

    code, got = _call(args, op)
    if got is None:
        return code
    res, back = got
    emit(args, {"published": res.version, "previous": res.previous, "revision": res.revision, "keyId": back.key_id},
         [f"rolled back: bundle {res.version} (the content of {res.previous}) is published to every agent; "
          "the canary is removed"])
    return EXIT_OK


# ------------------------------------------------------------------------------ status
def scrape(urls: list[str], headers: dict[str, str]) -> dict[str, Any]:
    """Per agent URL: its decision counts by (version, rule, outcome, tenant) and the versions it holds."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    with httpx.Client(timeout=3.0, headers=headers) as client:
        for url in urls:
            try:
                text = client.get(url + "/metrics").text
            except httpx.HTTPError as e:
                out[url] = {"error": str(e)}
                continue
            counts: dict[tuple, float] = defaultdict(float)
            held = {"current": None, "candidate": None}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "leasehold_agent_decisions_total":
                        lb = s.labels
                        counts[(int(lb["policy_version"]), lb["rule"], lb["outcome"], lb["tenant"])] += s.value
                    elif s.name == "leasehold_agent_policy_version":
                        held["current"] = int(s.value)
                    elif s.name == "leasehold_agent_policy_candidate_version":
                        held["candidate"] = int(s.value) or None
            out[url] = {"counts": counts, **held}
    return out


def population(scraped: dict[str, Any], version: int, tenants: list[str]) -> dict[str, Any]:
    total = denied = fallback = 0.0
    by_rule: dict[str, float] = defaultdict(float)
    for agent in scraped.values():
        for (v, rule, outcome, tenant), n in agent.get("counts", {}).items():
            if v != version or (tenants and tenant not in tenants):
                continue
            total += n
            if outcome in DENIED:
                denied += n
                by_rule[rule] += n
            if outcome in FALLBACK:
                fallback += n
    rates = {r: (n / total if total else 0.0) for r, n in by_rule.items()}
    return {"version": version, "decisions": total, "denialRate": denied / total if total else None,
            "fallbackRate": fallback / total if total else None, "ruleDenialRates": rates}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def cmd_status(args: argparse.Namespace) -> int:
    async def read(store):
        await store.trust_marker()  # verified first with the marker's keys, as the services do with theirs
        return (*await store.read_both(), store.key.decode())

    code, got = _call(args, read)
    if got is None:
        return code
    current, staged, key = got
    if current is None:
        return fail(args, f"nothing is published at {key}", EXIT_USAGE)
    if current.bundle is None:
        why = "invalid" if current.outcome == "invalid" else f"refused ({current.outcome})"
        return fail(args, f"nothing valid is published at {key}: {why}: {current.problem}", EXIT_USAGE)
    cur_v = current.bundle.bundle_version
    cand = staged.bundle if staged is not None else None
    sl = staged.slice if staged is not None else None
    if args.agent_urls:
        urls, headers = args.agent_urls, {}
        names = {u: u for u in urls}
    else:
        state = _cli()._state_or_exit(args.run_dir)
        agents = [s for s in state["services"] if s["kind"] == "agent"]
        urls = [s["url"] for s in agents]
        names = {s["url"]: f"{s['name']} ({s.get('region')})" for s in agents}
        headers = _cli()._auth_headers(args, "operator")
    scraped = scrape(urls, headers)
    if scraped and all("error" in a for a in scraped.values()):  # nothing measured is no "not worse" (exit 0)
        first = next(iter(scraped.items()))
        return fail(args, f"no agent answered on /metrics ({names[first[0]]}: {first[1]['error']}); nothing to "
                          "compare", EXIT_CONNECT)
    tenants = sl.tenants if sl is not None and sl.tenants and not (sl.regions or sl.agents) else []
    rest = population(scraped, cur_v, tenants)
    canary = population(scraped, cand.bundle_version, tenants) if cand is not None else None
    worse = []
    if canary is not None and canary["decisions"] >= args.min_decisions:
        for rule in sorted(set(canary["ruleDenialRates"]) | set(rest["ruleDenialRates"])):
            c, r = canary["ruleDenialRates"].get(rule, 0.0), rest["ruleDenialRates"].get(rule, 0.0)
            if c - r > args.margin:
                worse.append({"rule": rule, "canary": c, "current": r})
    doc = {"published": cur_v, "candidate": cand.bundle_version if cand else None,
           "slice": None if sl is None else {"regions": sl.regions, "agents": sl.agents, "tenants": sl.tenants},
           "comparedTenants": tenants or None, "margin": args.margin,
           "agents": [{"agent": names[u], "current": a.get("current"), "candidate": a.get("candidate"),
                       "error": a.get("error")} for u, a in scraped.items()],
           "canary": canary, "current": rest, "worse": worse}
    lines = [f"published bundle {cur_v}" + (f"; candidate {cand.bundle_version} staged for {sl.text()}"
                                              if cand is not None and sl is not None else "; no canary staged")]
    if staged is not None and cand is None:
        lines.append(f"the staged canary is invalid: {staged.problem}")
    for a in doc["agents"]:
        lines.append(f"  {a['agent']}: current {a['current']}, candidate {a['candidate'] or '-'}"
                     + (f"  (unreachable: {a['error']})" if a["error"] else ""))
    if canary is not None:
        scope = f" (tenants {', '.join(tenants)})" if tenants else ""
        lines.append(f"{'':<28} {'canary ' + str(canary['version']):>14} {'current ' + str(cur_v):>14}{scope}")
        lines.append(f"{'decisions':<28} {canary['decisions']:>14.0f} {rest['decisions']:>14.0f}")
        lines.append(f"{'denial rate':<28} {_pct(canary['denialRate']):>14} {_pct(rest['denialRate']):>14}")
        lines.append(f"{'fallback rate':<28} {_pct(canary['fallbackRate']):>14} {_pct(rest['fallbackRate']):>14}")
        for rule in sorted(set(canary["ruleDenialRates"]) | set(rest["ruleDenialRates"])):
            mark = "  <-- over the margin" if any(w["rule"] == rule for w in worse) else ""
            lines.append(f"{'denied by ' + rule:<28} {_pct(canary['ruleDenialRates'].get(rule, 0.0)):>14} "
                         f"{_pct(rest['ruleDenialRates'].get(rule, 0.0)):>14}{mark}")
        if canary["decisions"] < args.min_decisions:
            lines.append(f"not judged: {canary['decisions']:.0f} canary decisions, fewer than --min-decisions "
                         f"{args.min_decisions}")
    if worse:
        lines.append(f"CANARY WORSE: a rule's denial rate exceeds the current one's by more than "
                     f"{100 * args.margin:g} percentage points (exit 8)")
    emit(args, doc, lines)
    return EXIT_CANARY_WORSE if worse else EXIT_OK


# ------------------------------------------------------------------------------ registration
def url_list(text: str) -> list[str]:
    """Comma-separated agent base URLs (each as :func:`leasehold.commands.argtypes.http_url`)."""
    return sorted({http_url(x.strip()) for x in text.split(",") if x.strip()})


def register(psub: Any, etcd_opts: Any, out_opt: Any, key_opt: Any) -> None:
    sp = psub.add_parser("canary", help="stage a candidate bundle for a slice of agents (regions, agent ids) or "
                                        "tenants; the rest keeps the published bundle")
    sp.add_argument("file", help="the candidate: a bundle JSON or a policy source")
    sp.add_argument("--regions", type=names(REGION, "a region name"),
                    help="every agent of these regions (comma-separated)")
    sp.add_argument("--agents", type=names(NODE_ID, "an agent id"),
                    help="these agents (their --agent-id, comma-separated)")
    sp.add_argument("--tenants", type=names(TENANT_ID, "a tenant id"),
                    help="these tenants' requests, on every agent (comma-separated)")
    key_opt(sp)
    etcd_opts(sp)
    out_opt(sp)
    sp.set_defaults(func=cmd_canary)
    sp = psub.add_parser("promote", help="publish the staged candidate to every agent (same bytes, same signature)")
    etcd_opts(sp)
    out_opt(sp)
    sp.set_defaults(func=cmd_promote)
    sp = psub.add_parser("rollback", help="end a canary: the published content under a new, higher version")
    sp.add_argument("--as-version", type=int, help="default: one above the candidate's")
    sp.add_argument("--published-at")
    key_opt(sp)
    etcd_opts(sp)
    out_opt(sp)
    sp.set_defaults(func=cmd_rollback)
    sp = psub.add_parser("status", help="the canary and the rest side by side: decisions, denial and fallback "
                                        "rates, per rule (exit 8 when the canary denies more by over --margin)")
    sp.add_argument("--agent-urls", type=url_list, help="agents to read, comma-separated http(s)://host:port "
                                                        "(default: the running local topology's)")
    sp.add_argument("--margin", type=float, default=0.05,
                    help="a rule's canary denial rate may exceed the current one's by this fraction (default 0.05)")
    sp.add_argument("--min-decisions", type=int, default=20, help="canary decisions needed to judge (default 20)")
    etcd_opts(sp)
    out_opt(sp)
    sp.set_defaults(func=cmd_status)


__all__ = ["cmd_canary", "cmd_promote", "cmd_rollback", "cmd_status", "population", "register"]
