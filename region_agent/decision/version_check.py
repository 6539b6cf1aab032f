"""The version check: the bundle version a gateway has seen (``policyEpoch`` on the wire, a
documented alias: docs/glossary.md) against the bundle version in force, which is written into the
decision (``policyVersion``; docs/invariants.md I3, I13).

The agent decides with the bundle it holds and says which one in ``policyVersion``; it never
waits for or guesses at a bundle it does not have. ``policyEpoch`` is the gateway's view of the
current version, so a mismatch is a staleness signal on one side or the other:

* ``policyEpoch > policyVersion`` (the gateway has seen a newer bundle): counted as
  ``gateway_ahead`` and the agent refreshes its bundle source at once, at most once per
  ``min_interval_s`` — so a lost watch event is repaired by the first request that notices, not
  by the next periodic re-read. Following etcd, the read runs off the request path and this
  request is decided with the bundle in force (its ``policyVersion`` says which); from a bundle
  file, the file is looked at (a stat, a parse if it changed) before this request is decided.
* ``policyEpoch < policyVersion``: counted as ``gateway_behind`` (normal for a moment during a
  rollout; a steady rate means a gateway stuck on an old bundle).

``leasehold_agent_policy_epoch_mismatches_total{relation}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class VersionCheck:
    def __init__(self, metrics: Any, refresh: Callable[[], object] | None = None, *, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self._ahead = metrics.version_mismatches.labels("gateway_ahead")
        self._behind = metrics.version_mismatches.labels("gateway_behind")
        self.refresh = refresh
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._last = float("-inf")
        self.refreshes = 0

    def observe(self, seen: int | None, version: int) -> None:
        if seen is None or seen == version:
            return
        if seen < version:
            self._behind.inc()
            return
        self._ahead.inc()
        now = self.clock()
        if self.refresh is not None and now - self._last >= self.min_interval_s:
            self._last = now
            self.refreshes += 1
            self.refresh()
