"""Pre-authentication limiting (docs/invariants.md I9): the P-ANON per-IP stage's guards.

* **New keys per source.** An attacker rotating addresses inside a large range creates a new
  per-IP key (a new Redis key) per address. :class:`NewKeyCap` counts, per agent and per fixed
  window, the distinct per-IP keys (the rule's own prefix, e.g. /32 or /64) seen from each
  coarse source (/16 for IPv4, /32 for IPv6 by default). Past ``per_source`` distinct keys, a
  request from a *new* key of that source is denied (429, ``deniedScope: ip``) before any Redis
  call; keys already seen this window keep working. Memory is bounded: at most ``max_sources``
  coarse sources per window (a request from a new source past that is denied too) and
  ``per_source`` keys each; everything is dropped when the window rolls.
* **Failed authentication.** A gateway reports a failed authentication with ``authFailed: true``
  and the caller's ``clientIp``. The request is evaluated as an anonymous request from that
  address: only ip-scoped rules apply, the claimed tenant and principal are dropped, so failed
  logins for tenant Atlas spend the IP budget and never Atlas's keys.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kernel.bundle import Rule
from kernel.errors import ValidationFailed

from ..models import AdmitRequest, Decision, DecisionSource, DeniedScope, Principal, Reason
from .keys import ip_prefix, parse_ip
from .outcome import Answer
from .plan import Snapshot
from .record import early_record

if TYPE_CHECKING:
    from ..service.metrics import AgentMetrics


def as_failed_auth(req: AdmitRequest) -> AdmitRequest:
    """The request a failed authentication is evaluated as: anonymous, from ``clientIp``."""
    if req.client_ip is None:
        raise ValidationFailed("clientIp is required with authFailed: true",
                               errors=["clientIp: required when authFailed is true"])
    parse_ip(req.client_ip)  # 422 on a non-address, before anything else
    return AdmitRequest(request_id=req.request_id, principal=Principal(type="anonymous", id=req.client_ip),
                        route_group=req.route_group, method=req.method, tenant_id=None, cost_hint=req.cost_hint,
                        bundle_version=req.bundle_version)


class NewKeyCap:
    def __init__(self, *, per_source: int, window_ms: int, max_sources: int = 10_000, v4_coarse: int = 16,
                 v6_coarse: int = 32, clock: Callable[[], float] = time.monotonic):
        self.per_source = per_source
        self.window_ms = window_ms
        self.max_sources = max_sources
        self.v4_coarse = v4_coarse
        self.v6_coarse = v6_coarse
        self.clock = clock
        self._window = -1
        self._seen: dict[str, set[str]] = {}
        self.refused = 0

    def admit(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, rule: Rule) -> bool:
        """False when ``addr``'s key under ``rule`` would be one new key too many for its source."""
        window = int(self.clock() * 1000) // self.window_ms
        if window != self._window:
            self._window, self._seen = window, {}
        source = ip_prefix(addr, self.v4_coarse, self.v6_coarse)
        key = ip_prefix(addr, rule.ipv4_prefix, rule.ipv6_prefix)
        keys = self._seen.get(source)
        if keys is None:
            if len(self._seen) >= self.max_sources:
                self.refused += 1
                return False
            keys = self._seen[source] = set()
        if key in keys:
            return True
        if len(keys) >= self.per_source:
            self.refused += 1
            return False
        keys.add(key)
        return True

    def check(self, snap: Snapshot, req: AdmitRequest, metrics: AgentMetrics | None = None) -> Decision | None:
        """The denial for an anonymous request from a new key past its source's cap, else None;
        counted in ``metrics`` (source ``preauth``, the rule whose cap refused)."""
        if req.principal.type != "anonymous":
            return None
        addr = parse_ip(req.principal.id)
        rules = [r for r in snap.selected(tenant=None, route_group=req.route_group, principal=req.principal)
                 if r.scope == "ip" and not r.shadow]
        refused = next((r for r in rules if not self.admit(addr, r)), None)
        if refused is None:
            return None
        answer = Answer(False, None, scope=DeniedScope.IP, reason=Reason.RATE_EXCEEDED,
                        retry=self.window_ms - int(self.clock() * 1000) % self.window_ms)
        return early_record(req, snap, answer, DecisionSource.PREAUTH, metrics, counted=refused, tenant=None)
