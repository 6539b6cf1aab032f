"""Offline replay of the sampled decision log (region_agent/service/decision_log.py) through a bundle:
``leasehold policy replay NEW --log FILES [--against CURRENT]`` (docs/policy.md, "Replay").

Every logged question is asked again of the bundle: the agent's own plan
(:func:`region_agent.decision.plan.build_plan`: rule selection, overrides, exemptions, the script call's
slots and parameters) decided by the scripts' reference models (:mod:`kernel.algorithms`, the same
integer arithmetic as ``lua/lib/*.lua``; the Lua-vs-model differential tests hold them equal),
at the time the log recorded. Pure models rather than the Lua scripts on a throwaway Redis:
the scripts read the time from Redis ``TIME``, while a replay must run at the log's own
timestamps, in order, as fast as it can; the models take the time as an argument, need no
server, and answer the same. State is kept per region for the regional rules (each region has
its own Redis) and once for the pools, which the allocator holds fleet-wide.

What is estimated and how:

* **Sampling.** A line sampled at rate r stands for 1/r decisions of its caller (same region,
  tenant, principal, API key, route group and cost). They are replayed as that many questions
  spread evenly over the time since that caller's previous line (a fraction is carried to the
  caller's next line), so a steady caller is replayed at its rate. Record at rate 1.0 (the
  default for denials and fallbacks) for an exact replay; allows at a low rate give an
  estimate that smooths bursts.
* **Pools** are replayed as the allocator's ideal: the pool's limit per aligned window across all
  regions (no fallback allowances, no lease granularity).
* **Not replayed:** concurrency gates (the log does not say when a request ended; their slots
  are left out of the call), shadow rules, and an ip rule's prefix change (the log holds only the
  hash of the address at the prefix in force when it was recorded).

The denial rate of a rule is the questions it denied (it was the reported, first denying rule)
over the questions it was evaluated for.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kernel.algorithms import Role
from kernel.algorithms.multi_rule import RuleSpec, decide
from kernel.bundle import Bundle
from kernel.errors import LeaseholdError
from kernel.ids import is_id_text
from region_agent.decision.keys import KeyBuilder
from region_agent.decision.plan import Snapshot, build_plan
from region_agent.models import ID_MAX_CHARS, AdmitRequest, Principal
from region_agent.service.decision_log import Line

DENIED = ("denied", "fallback_denied")
MAX_EVENTS = 5_000_000


class ReplayError(Exception):
    pass


@dataclass
class Event:
    ts: int
    line: Line
    n: int  # copy number of the line (0: the line itself)


@dataclass
class RuleStats:
    evaluated: float = 0.0
    denied: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.denied / self.evaluated if self.evaluated else None


@dataclass
class Result:
    name: str
    version: int | None
    rules: dict[str, RuleStats] = field(default_factory=lambda: defaultdict(RuleStats))
    questions: float = 0.0
    denied: float = 0.0
    skipped: int = 0  # questions the bundle refused to plan (e.g. a tenant id it rejects)


# ------------------------------------------------------------------------------ reading
def read_log(paths: Iterable[str | Path]) -> tuple[list[Line], int]:
    """Every line of the log files (rotated ones too, in any order), sorted by time; and the count
    of lines that were not decision lines."""
    dec = msgspec.json.Decoder(Line)
    out: list[Line] = []
    bad = 0
    for p in paths:
        try:
            data = Path(p).read_bytes()
        except OSError as e:
            raise ReplayError(f"cannot read {p}: {e.strerror}") from None
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                line = dec.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError):
                bad += 1
                continue
            if not 0 < line.rate <= 1 or not _keyable(line):
                bad += 1
                continue
            out.append(line)
    out.sort(key=lambda x: (x.ts, x.id))
    return out, bad


_HEX = re.compile(r"[0-9a-f]{1,64}")  # an anonymous caller's logged address hash


def _keyable(line: Line) -> bool:
    """The line's caller is one a door would take: an address hash for an anonymous caller, else
    identity text (kernel.ids) of at most ``ID_MAX_CHARS`` for the principal and any API key id; a
    hand-edited line may not be."""
    if line.type == "anonymous":
        return _HEX.fullmatch(line.principal) is not None
    return (is_id_text(line.principal) and len(line.principal) <= ID_MAX_CHARS
            and (line.apiKey is None or (is_id_text(line.apiKey) and len(line.apiKey) <= ID_MAX_CHARS)))


def _caller(line: Line) -> tuple:
    return (line.region, line.tenant, line.type, line.principal, line.apiKey, line.route, line.cost)


def expand(lines: list[Line], max_events: int = MAX_EVENTS) -> list[Event]:
    """The questions the sampled lines stand for, in time order (see the module doc)."""
    prev: dict[tuple, int] = {}
    carry: dict[tuple, float] = defaultdict(float)
    start = lines[0].ts if lines else 0
    events: list[Event] = []
    for line in lines:
        k = _caller(line)
        carry[k] += 1.0 / line.rate
        n = int(math.floor(carry[k] + 1e-9))
        carry[k] -= n
        since = prev.get(k, start)
        prev[k] = line.ts
        gap = max(0, line.ts - since)
        for c in range(n):
            events.append(Event(line.ts - (gap * c) // n, line, c))
        if len(events) > max_events:
            raise ReplayError(f"the log stands for more than {max_events} questions at its sample rates; replay "
                              "fewer files or raise --max-events")
    events.sort(key=lambda e: (e.ts, e.line.id, e.n))
    return events


def observed(lines: list[Line]) -> Result:
    """What the log itself says (each line weighed by 1 / its rate)."""
    res = Result("observed", None)
    for line in lines:
        w = 1.0 / line.rate
        res.questions += w
        for rid in line.rules:
            res.rules[rid].evaluated += w
        if line.outcome in DENIED:
            res.denied += w
            if line.rule:
                res.rules[line.rule].denied += w
    return res


# ------------------------------------------------------------------------------ replaying
def _address(h: str) -> str:
    """A stand-in address for an anonymous caller's hash: its own /64 (the log holds no address)."""
    return str(ipaddress.IPv6Address((0xFD << 120) | ((int(h[:14], 16) & ((1 << 56) - 1)) << 64) | 1))


def _request(e: Event) -> AdmitRequest:
    line = e.line
    rid = f"{line.id[:100]}.{e.n}"
    if len(rid) < 8:
        rid = rid.rjust(8, "0")
    if line.type == "anonymous":
        principal = Principal(type="anonymous", id=_address(line.principal))
    else:
        principal = Principal(type=line.type, id=line.principal, api_key_id=line.apiKey)  # type: ignore[arg-type]  # the log line's type was checked when the line was decoded
    return AdmitRequest(request_id=rid, principal=principal, route_group=line.route, tenant_id=line.tenant,
                        cost_hint=max(1, min(1000, line.cost)))


def replay(bundle: Bundle, events: list[Event], name: str) -> Result:
    """Ask ``bundle`` every question of ``events`` (see the module doc)."""
    keys = KeyBuilder(b"leasehold-replay")
    snap = Snapshot(bundle)
    pools = snap.pools
    state: dict[tuple, Any] = {}
    res = Result(name, bundle.bundle_version)
    for e in events:
        try:
            plan = build_plan(snap, _request(e), keys)
        except LeaseholdError:
            res.skipped += 1
            continue
        region = e.line.region
        specs: list[RuleSpec] = []
        owners: list[str] = []
        skeys: list[tuple] = []
        for g in plan.global_spends:  # fleet-wide pools: taken before the tenant call, as the engine does
            specs.append(RuleSpec("fw", (g.pool.limit, g.pool.window_ms, g.cost, 0, 0)))
            owners.append(g.rule.id)
            skeys.append(("pool", g.pool.id))
        for a in plan.approx:  # approximate rules: replayed as their exact count (what they approximate)
            specs.append(RuleSpec(a.rule.kind.code, a.rule.script_params(plan.cost_hint)))
            skeys.append((region, a.key))
            owners.append(a.rule.id)
        for slot, call in zip(plan.slots, plan.calls, strict=True):
            if slot.role is Role.CC:
                continue  # concurrency gates are not replayed
            if slot.role is Role.POOL:
                pool = pools[slot.rule.pool_id or ""]
                specs.append(RuleSpec("fw", (pool.limit, pool.window_ms, call.params[0], 0, 0)))
                skeys.append(("pool", call.key))
            else:
                specs.append(RuleSpec(call.kind, tuple(call.params)))  # type: ignore[arg-type]  # a plan's params have the length its kind takes
                skeys.append((region, call.key))
            owners.append(slot.rule.id)
        res.questions += 1
        for r in plan.rules:
            res.rules[r.id].evaluated += 1
        if not specs:
            continue
        d, new = decide([state.get(k) for k in skeys], specs, e.ts, plan.request_id)
        if d.allowed and new is not None:
            for k, s in zip(skeys, new, strict=True):
                state[k] = s
        elif not d.allowed:
            res.denied += 1
            res.rules[owners[d.denied_by - 1]].denied += 1
    return res


# ------------------------------------------------------------------------------ report
@dataclass
class Row:
    rule: str
    evaluated: float
    observed: float | None
    current: float | None
    new: float | None
    flag: str  # "" | "up" | "down"


def compare(obs: Result, current: Result, new: Result, threshold: float) -> list[Row]:
    rows = []
    ids = list(dict.fromkeys([*new.rules, *current.rules, *obs.rules]))
    for rid in ids:
        c, n = current.rules.get(rid), new.rules.get(rid)
        cr, nr = (c.rate if c else None), (n.rate if n else None)
        flag = ""
        if cr is not None or nr is not None:
            delta = (nr or 0.0) - (cr or 0.0)
            if abs(delta) > threshold:
                flag = "up" if delta > 0 else "down"
        o = obs.rules.get(rid)
        rows.append(Row(rid, (n or c or o or RuleStats()).evaluated, o.rate if o else None, cr, nr, flag))
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(rows: list[Row], obs: Result, current: Result, new: Result, threshold: float, lines: int,
           events: int, bad: int) -> list[str]:
    out = [f"replayed {lines} logged decisions as {events} questions ({bad} unreadable lines skipped); "
           f"current: {current.name}, new: {new.name}"]
    head = f"{'rule':<28} {'questions':>10} {'observed':>9} {'current':>9} {'new':>9} {'change':>8}"
    out += [head, "-" * len(head)]
    for r in rows:
        delta = "" if r.current is None and r.new is None else f"{100 * ((r.new or 0) - (r.current or 0)):+.1f}pp"
        mark = {"up": "  <-- denies more", "down": "  <-- denies less"}.get(r.flag, "")
        out.append(f"{r.rule:<28} {r.evaluated:>10.0f} {_pct(r.observed):>9} {_pct(r.current):>9} "
                   f"{_pct(r.new):>9} {delta:>8}{mark}")
    total = [(x.denied / x.questions if x.questions else None) for x in (obs, current, new)]
    out.append(f"{'all questions':<28} {new.questions:>10.0f} {_pct(total[0]):>9} {_pct(total[1]):>9} "
               f"{_pct(total[2]):>9}")
    out.append(f"flagged: a rule's denial rate changes by more than {100 * threshold:g} percentage points")
    if new.skipped or current.skipped:
        out.append(f"questions the bundle could not plan (skipped): current {current.skipped}, new {new.skipped}")
    return out


__all__ = ["ReplayError", "Result", "Row", "compare", "expand", "observed", "read_log", "render", "replay"]
