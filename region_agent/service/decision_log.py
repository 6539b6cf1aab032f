"""The sampled decision log (off by default; ``--decision-log FILE``): one JSON line per sampled
decision, the input of ``leasehold policy replay`` (docs/policy.md, "The decision log").

Sampling is per outcome class: allowed decisions at ``--decision-log-allow-rate`` (low, 0.01 by
default), denials at ``--decision-log-deny-rate`` and fallback decisions (either way) at
``--decision-log-fallback-rate`` (both 1.0). Each line carries the rate it was sampled at, so a
reader weighs it by ``1 / rate``. The file is bounded twice: at most
``--decision-log-bytes-per-s`` (a token bucket of bytes, one second of burst; a line over the
budget is dropped and counted, ``leasehold_agent_decision_log_lines_total{result="dropped"}``),
and rotated by size (``--decision-log-max-bytes``, ``--decision-log-backups`` old files kept:
``FILE.1`` is the newest; the standard library's ``RotatingFileHandler``).

A line (keys in this order)::

    {"ts": 1767225600123, "id": "<decision id>", "region": "eu", "agent": "agent-eu-1",
     "tenant": "atlas", "type": "user", "principal": "<keyed hash>", "apiKey": "<keyed hash>" | null,
     "route": "read", "cost": 1, "rules": ["read-user-v3", ...], "rule": "<deciding rule>" | null,
     "outcome": "denied", "reason": "RATE_EXCEEDED" | null, "fallback": false, "version": 42, "rate": 1.0}

``principal`` and ``apiKey`` are the keyed hashes (HMAC with the agents' pepper) the Redis keys
already hold — never the principal, the API key or the address (an anonymous caller's is the
hash of its address at the widest prefix its ip rules count by). ``rules`` are the rules the
request was evaluated against (in order), ``rule`` the one the decision reports (the denying one
for a denial), ``version`` the bundle version it was evaluated with.

Cost when off: the engine holds ``None`` and tests it once per decision.
"""

from __future__ import annotations

import logging
import logging.handlers
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kernel.bundle import Bundle

from ..decision.keys import KeyBuilder, hash_tag
from ..decision.plan import Plan
from ..models import Decision

log = logging.getLogger(__name__)


def outcome_of(d: Decision) -> str:
    """The decision's outcome class, as the decisions counter names it (region_agent.decision.telemetry)."""
    if d.allowed:
        return "fallback_allowed" if d.fallback else "allowed"
    if d.reason == "OVERLOADED":
        return "shed"
    if d.http_status == 503:
        return "unavailable"
    if d.http_status == 409:
        return "conflict"
    return "fallback_denied" if d.fallback else "denied"


class Line(msgspec.Struct, array_like=False, omit_defaults=False):
    ts: int
    id: str
    region: str
    agent: str
    tenant: str | None
    type: str
    principal: str
    apiKey: str | None  # noqa: N815 - the wire name
    route: str
    cost: int
    rules: list[str]
    rule: str | None
    outcome: str
    reason: str | None
    fallback: bool
    version: int
    rate: float


class DecisionLog:
    def __init__(self, path: str, *, keys: KeyBuilder, region: str, agent: str, allow_rate: float = 0.01,
                 deny_rate: float = 1.0, fallback_rate: float = 1.0, bytes_per_s: int = 262_144,
                 max_bytes: int = 64 << 20, backups: int = 5, metrics: Any = None,
                 wall_clock: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic,
                 sample: Callable[[], float] = random.random):
        self.keys, self.region, self.agent = keys, region, agent
        self.allow_rate, self.deny_rate, self.fallback_rate = allow_rate, deny_rate, fallback_rate
        self.bytes_per_s = bytes_per_s
        self._budget = float(bytes_per_s)  # a token bucket of bytes: one second of burst
        self._at = clock()
        self.clock, self.wall_clock, self.sample = clock, wall_clock, sample
        self._written = metrics.decision_log_lines.labels("written") if metrics is not None else None
        self._dropped = metrics.decision_log_lines.labels("dropped") if metrics is not None else None
        self.handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                            encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.handler.handleError = self._failed  # type: ignore[method-assign]  # counted, not printed per line
        self._encode = msgspec.json.Encoder().encode
        self._failed_write = False

    @classmethod
    def from_settings(cls, settings: Any, keys: KeyBuilder, metrics: Any = None) -> DecisionLog | None:
        if not settings.decision_log:
            return None
        return cls(settings.decision_log, keys=keys, region=settings.region, agent=settings.agent_id or settings.region,
                   allow_rate=settings.decision_log_allow_rate, deny_rate=settings.decision_log_deny_rate,
                   fallback_rate=settings.decision_log_fallback_rate, bytes_per_s=settings.decision_log_bytes_per_s,
                   max_bytes=settings.decision_log_max_bytes, backups=settings.decision_log_backups, metrics=metrics)

    # ------------------------------------------------------------------ per decision
    def decided(self, plan: Plan, bundle: Bundle, d: Decision) -> None:
        """Sample ``d`` (the decision of ``plan`` under ``bundle``) and write its line if sampled."""
        rate = self.fallback_rate if d.fallback else self.allow_rate if d.allowed else self.deny_rate
        if rate <= 0.0 or (rate < 1.0 and self.sample() >= rate):
            return
        req = plan.request
        if req is None:
            return
        raw = self._encode(self.line(plan, bundle, d, rate))
        now = self.clock()
        self._budget = min(float(self.bytes_per_s), self._budget + (now - self._at) * self.bytes_per_s)
        self._at = now
        if len(raw) + 1 > self._budget:
            self._count(self._dropped)
            return
        self._budget -= len(raw) + 1
        self._failed_write = False
        self._write(raw.decode())
        self._count(self._dropped if self._failed_write else self._written)

    def _failed(self, record: logging.LogRecord) -> None:
        """The handler could not write (e.g. a full disk): the line is dropped, never the decision."""
        if not self._failed_write:
            log.warning("decision log write failed; the line is dropped")
        self._failed_write = True

    def line(self, plan: Plan, bundle: Bundle, d: Decision, rate: float) -> Line:
        req = plan.request
        assert req is not None
        p = req.principal
        tenant = plan.tenant
        if p.type == "anonymous":
            principal = hash_tag(plan.decision_key).removeprefix("ip:")  # the keyed hash of the address's prefix
        else:
            principal = self.keys.h(tenant or "", "u" if p.type == "user" else "s", p.id)
        api_key = self.keys.h(tenant or "", "k", p.api_key_id) if p.api_key_id else None
        return Line(int(self.wall_clock() * 1000), d.decision_id, self.region, self.agent, tenant, p.type, principal,
                    api_key, req.route_group, req.cost_hint, [r.id for r in plan.rules], d.rule_id, outcome_of(d),
                    None if d.reason is None else str(d.reason), d.fallback, d.bundle_version, rate)

    def _write(self, text: str) -> None:
        """One line through the handler: it rotates by size, writes and flushes."""
        self.handler.emit(logging.makeLogRecord({"msg": text, "levelno": logging.INFO}))

    def close(self) -> None:
        self.handler.close()

    @staticmethod
    def _count(child: Any) -> None:
        if child is not None:
            child.inc()


__all__ = ["DecisionLog", "Line", "outcome_of"]
