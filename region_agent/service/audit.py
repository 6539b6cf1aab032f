"""Audit trail of privileged bypasses (docs/invariants.md I14: "a privileged bypass is narrow,
separately authenticated and audited ... an unmetered bypass is a flood channel").

An ``exempt`` rule replaces a tenant's other rules by its own cap and names an ``owner``
(``kernel.bundle`` validation: it names a tenant, has an owner, never fails open, is never a
shadow rule). Its cap is enforced by the same script as every other rule. Every decision made
under an exempt rule is:

* **counted**: ``leasehold_agent_bypass_decisions_total{rule, outcome}``;
* **audited**, as one JSON line (``--audit-log FILE``, default the agent's stderr):

  - each *allowed* bypass decision -> exactly one event
    ``{"event": "bypass", "ts", "rule", "owner", "tenant", "routeGroup", "requestId",
    "policyVersion", "outcome", "fallback"}`` — never the principal, its key or its address;
    the cap bounds how many there can be;
  - *denied* bypass decisions (the cap reached, or the limiter unavailable) -> at most one
    ``"bypass_denied"`` event per rule per second, naming that denial's request and carrying
    ``"suppressed"``: the denials of that rule not logged since the previous denial event. What is
    still suppressed when the second is over is written by :meth:`BypassAudit.flush` (the agent's
    background loop, and at shutdown) as a ``"bypass_denied"`` event with ``"requestId": null``.
    So the events of a rule add up to every denial (events + suppressed), yet a flood past the cap
    costs at most about two lines per rule per second.

A write that fails is counted (``leasehold_agent_audit_write_errors_total``) and never fails
the decision.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
import time
from collections.abc import Callable

from kernel.bundle import Rule
from kernel.caches import BoundedMemo

LOGGER = "leasehold.audit"
DENIAL_EVENT_INTERVAL_S = 1.0
MAX_RULES_TRACKED = 10_000  # (rule, outcome) counters and per-rule denial throttles kept (emptied when full)


def make_sink(path: str | None) -> Callable[[str], None]:
    """A writer of one JSON line: appended to ``path`` (its own file, apart from the service's
    logs; O_APPEND, one write per line, so several workers can share the file; opened at the
    first event), or with ``-`` / None the ``leasehold.audit`` logger on stderr. A file that
    cannot be opened or written raises ``OSError`` (counted as an audit write error)."""
    if path and path != "-":
        held: list = []

        def to_file(line: str) -> None:
            if not held:
                held.append(open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 - kept open
            held[0].write(line + "\n")
        return to_file
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger.info


class BypassAudit:
    def __init__(self, metrics, sink: Callable[[str], None], *, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.sink = sink
        self.wall = wall
        self.clock = clock
        self._denied: BoundedMemo[str, list] = BoundedMemo(MAX_RULES_TRACKED)  # rule id -> [last event, suppressed]
        self._counters: BoundedMemo[tuple[str, str], object] = BoundedMemo(MAX_RULES_TRACKED)

    def decided(self, rule: Rule, *, outcome: str, tenant: str | None, request_id: str, version: int,
                fallback: bool) -> None:
        counter = self._counters.get((rule.id, outcome))
        if counter is None:
            counter = self._counters.put((rule.id, outcome), self.metrics.bypass_decisions.labels(rule.id, outcome))
        counter.inc()  # type: ignore[attr-defined]  # the memo's values are prometheus Counter children
        event = {"ts": _dt.datetime.fromtimestamp(self.wall(), _dt.UTC).isoformat(timespec="milliseconds"),
                 "rule": rule.id, "owner": rule.owner, "tenant": tenant, "routeGroup": rule.route_key,
                 "requestId": request_id, "policyVersion": version, "outcome": outcome, "fallback": fallback}
        if outcome in ("allowed", "fallback_allowed"):
            self._write("bypass", event)
            return
        now = self.clock()
        state = self._denied.get(rule.id)
        if state is None:
            state = self._denied.put(rule.id, [now - DENIAL_EVENT_INTERVAL_S, 0])
        if now - state[0] < DENIAL_EVENT_INTERVAL_S:
            state[1] += 1
            return
        event["suppressed"] = state[1]
        state[0], state[1] = now, 0
        self._write("bypass_denied", event)

    def flush(self, *, force: bool = False) -> None:
        """Write the denials still suppressed for rules whose second is over (all with ``force``)."""
        now = self.clock()
        for rule_id, state in list(self._denied.items()):
            if state[1] and (force or now - state[0] >= DENIAL_EVENT_INTERVAL_S):
                ts = _dt.datetime.fromtimestamp(self.wall(), _dt.UTC).isoformat(timespec="milliseconds")
                self._write("bypass_denied", {"ts": ts, "rule": rule_id, "requestId": None, "suppressed": state[1]})
                state[0], state[1] = now, 0

    def _write(self, kind: str, event: dict) -> None:
        try:
            self.sink(json.dumps({"event": kind, **event}, separators=(",", ":")))
        except Exception:  # noqa: BLE001 - an audit sink failure must not fail the decision
            self.metrics.audit_errors.inc()
            return
        self.metrics.audit_events.labels(kind).inc()
