"""The allocator follows the published bundle too: its pools come from the latest valid bundle
with a strictly higher version (the same rule as the agents). An accepted bundle's pools go to
the writer (``use_pools``, given in the constructor), which swaps its pool map in one assignment,
so a grant decision sees one bundle's pools.

A pool's new ``limit`` applies to the next grant decisions of the current window (grants
already made stay); changing a pool's ``windowMs`` under the same id is not supported
mid-flight — publish a new pool id instead.

With trusted public keys (``--policy-public-keys``) a bundle must also carry a signature that
verifies with one of them (``kernel.signing``), verified before the bundle is validated (the
watcher's store holds the keys); an unsigned, wrongly signed or untrusted-key bundle is refused and
counted like the agents do, and the pools in force stay."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kernel.bundle import Bundle, Pool
from kernel.errors import StaleVersion
from kernel.policy_store import PolicyStore
from kernel.signing import SignatureRefused, TrustedKeys
from kernel.watch import PolicyWatcher

from ..metrics import AllocatorMetrics

log = logging.getLogger(__name__)


class AllocatorPolicy:
    """The bundle in force at the allocator, fed by a :class:`PolicyWatcher`."""

    def __init__(self, bundle: Bundle, use_pools: Callable[[Iterable[Pool]], None], metrics: AllocatorMetrics,
                 trusted: TrustedKeys | None = None):
        self.bundle = bundle
        self.use_pools = use_pools
        self.metrics = metrics
        self.trusted = trusted or TrustedKeys()
        self.reloads = metrics.policy_reloads
        self.version = metrics.bundle_version
        self.version.set(bundle.bundle_version)

    def offer(self, candidate: Bundle) -> str:
        if candidate == self.bundle:  # the bundle in force again (etcd holding the start file's): not a refusal
            return "unchanged"
        try:
            self.trusted.check(candidate)
        except SignatureRefused as e:
            log.warning("policy refused (%s): %s", e.outcome, e.detail)
            self.reloads.labels(e.outcome).inc()
            return e.outcome
        if candidate.bundle_version <= self.bundle.bundle_version:
            err = StaleVersion(f"bundle {candidate.bundle_version} is not newer than {self.bundle.bundle_version}")
            log.warning("policy refused (stale): %s", err.detail)
            self.reloads.labels("stale").inc()
            return "stale"
        self.use_pools(candidate.pools)
        self.metrics.describe_pools(candidate.pools)
        self.bundle = candidate
        self.version.set(candidate.bundle_version)
        self.reloads.labels("accepted").inc()
        log.info("policy bundle %s accepted (%d pools)", candidate.bundle_version, len(candidate.pools))
        return "accepted"

    def refuse(self, detail: str, outcome: str = "invalid") -> str:
        """A bundle refused before it could be offered: ``invalid``, or the signature outcome the store
        checked first (a bundle that does not verify is never validated)."""
        log.warning("policy refused (%s): %s", outcome, detail)
        self.reloads.labels(outcome).inc()
        return outcome

    def watcher(self, store: PolicyStore, reread_s: float = 5.0) -> PolicyWatcher:
        w = PolicyWatcher(store, offer=self.offer, refuse=self.refuse, reread_s=reread_s)
        self.metrics.policy_age.set_function(lambda: w.age_ms() / 1000.0)
        return w
