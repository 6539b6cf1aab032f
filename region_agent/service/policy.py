"""The policy snapshot in force and its reload rules.

A request reads :meth:`PolicyHolder.snapshot_for` once and is evaluated against that snapshot end
to end. Accepting a bundle makes its :class:`~region_agent.decision.plan.Snapshot` (everything the request
path derives from the bundle once, with this agent's retry jitter); the snapshot goes when its
bundle is replaced. A reload accepts only a valid bundle with a strictly higher ``bundleVersion`` and, when
trusted public keys are configured (``--policy-public-keys``), a signature that verifies with
one of them (``kernel.signing``), verified before the bundle is validated; anything else keeps the
current snapshot and is counted."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernel.bundle import Bundle, load_bundle_file
from kernel.errors import PolicyError, StaleVersion
from kernel.policy_metrics import RELOAD_OUTCOMES  # noqa: F401  (re-exported: the outcomes of a reload)
from kernel.signing import SignatureRefused, TrustedKeys

from ..decision.httpmap import RetryJitter
from ..decision.plan import Snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    outcome: str  # one of RELOAD_OUTCOMES, or "unchanged" (the bundle in force offered again: not reported)
    version: int
    detail: str = ""


class PolicyHolder:
    def __init__(self, path: str, bundle: Bundle, *, on_reload: Callable[[ReloadResult], None] | None = None,
                 trusted: TrustedKeys | None = None, jitter: RetryJitter | None = None):
        self.path = path
        self.trusted = trusted or TrustedKeys()
        self.trusted.check(bundle)  # the start bundle too: raises SignatureRefused
        self.jitter = jitter if jitter is not None else RetryJitter()  # this agent's (its settings)
        self._snap = Snapshot(bundle, self.jitter)
        self._mtime = self._stat()
        self._on_reload = on_reload
        self.checked_at = time.monotonic()  # last successful look at the file (the snapshot age without etcd)
        # the canary (docs/policy.md, "Canary release"): the candidate this agent holds for its slice,
        # and the tenants it applies to (None: every request of this agent)
        self.candidate: Bundle | None = None
        self._candidate_snap: Snapshot | None = None
        self.candidate_tenants: frozenset[str] | None = None
        self.region: str | None = None
        self.agent_id: str | None = None
        self.on_canary: Callable[[str, int], None] | None = None  # (outcome, candidate version or 0)

    @classmethod
    def load(cls, path: str, **kw: Any) -> PolicyHolder:
        """Load at start; raises PolicyError (listing every problem) on an invalid bundle, or
        SignatureRefused when keys are trusted and the bundle's signature is not acceptable (checked
        first: an unverifiable bundle is not validated)."""
        trusted = kw.get("trusted") or TrustedKeys()
        return cls(path, load_bundle_file(path, verify=trusted.check), **kw)

    @property
    def bundle(self) -> Bundle:
        """The current (published) bundle."""
        return self._snap.bundle

    def set_jitter(self, jitter: RetryJitter) -> None:
        """Answer with ``jitter`` from now on (the agent's settings, for a holder made before them)."""
        self.jitter = jitter
        self._snap = Snapshot(self._snap.bundle, jitter)
        if self._candidate_snap is not None:
            self._candidate_snap = Snapshot(self._candidate_snap.bundle, jitter)

    @property
    def snapshot(self) -> Snapshot:
        """The current bundle's snapshot."""
        return self._snap

    def snapshot_for(self, tenant: str | None) -> Snapshot:
        """The snapshot one request of ``tenant`` is evaluated against: the candidate's when the
        request is in this agent's slice, else the current one. Read once per request."""
        cand = self._candidate_snap
        if cand is None:
            return self._snap
        tenants = self.candidate_tenants
        return cand if tenants is None or tenant in tenants else self._snap

    def bundle_for(self, tenant: str | None) -> Bundle:
        """The bundle of :meth:`snapshot_for`."""
        return self.snapshot_for(tenant).bundle

    def _stat(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def offer(self, candidate: Bundle) -> ReloadResult:
        """Swap to ``candidate`` if its signature is acceptable and its version strictly higher
        (it is already validated)."""
        current = self._snap.bundle
        if candidate == current:  # the bundle in force again (etcd holding the start file's bundle, a touched
            return ReloadResult("unchanged", current.bundle_version)  # file): nothing refused, not reported
        try:
            self.trusted.check(candidate)
        except SignatureRefused as e:
            return self._report(ReloadResult(e.outcome, current.bundle_version, e.detail))
        if candidate.bundle_version <= current.bundle_version:
            err = StaleVersion(f"bundle {candidate.bundle_version} is not newer than {current.bundle_version}")
            return self._report(ReloadResult("stale", current.bundle_version, err.detail))
        self._snap = Snapshot(candidate, self.jitter)  # one reference assignment: readers see old or new, never a mix
        return self._report(ReloadResult("accepted", candidate.bundle_version))

    # ------------------------------------------------------------------ the canary
    def offer_canary(self, staged: Any) -> str:
        """The canary key's value (``kernel.policy_store.StoredCanary``, None when absent), offered
        after the current bundle of the same etcd revision. What this agent *holds* is the current
        bundle and, when it is in the slice, the candidate with the part of the slice that is this
        agent's (all its requests, or some tenants'). The rule: a request is never evaluated with a
        lower version than an earlier request of the same tenant on this agent was. So the candidate
        is dropped only once the current version reaches it (promote, rollback), is replaced only by
        a higher version (or the same bundle), and its slice here only widens; any other offer keeps
        what is held (``kept``). The whole change is made without an await: a request sees the old
        pair or the new one."""
        held = self.candidate
        if held is not None and held.bundle_version <= self._snap.bundle.bundle_version:
            self._set_candidate(None, None)  # promoted or rolled back past it
            held = None
        if staged is None or staged.bundle is None:
            if staged is not None:  # its signature (checked first by the store) or its validation
                why = "" if staged.outcome == "invalid" else f" ({staged.outcome})"
                return self._canary("refused", f"canary refused{why}: {staged.problem}")
            return self._canary("kept", "canary removed without promote or rollback: the slice keeps the "
                                        f"candidate {held.bundle_version}") if held is not None else "none"
        cand = staged.bundle
        try:
            self.trusted.check(cand)
        except SignatureRefused as e:
            return self._canary("refused", f"canary refused ({e.outcome}): {e.detail}")
        if cand.bundle_version <= self._snap.bundle.bundle_version:
            return "none" if held is None else self._canary("kept", "stale canary")
        if cand.pools != self._snap.bundle.pools:
            return self._canary("refused", "canary refused: it changes the pools")
        sl = staged.slice
        whole = (self.region is not None and self.region in sl.regions) or \
            (self.agent_id is not None and self.agent_id in sl.agents)
        tenants = None if whole else frozenset(sl.tenants)
        if held is not None:
            narrower = tenants is not None and (self.candidate_tenants is None or not tenants >= self.candidate_tenants)
            lower = cand.bundle_version < held.bundle_version or (
                cand.bundle_version == held.bundle_version and cand.checksum != held.checksum)
            if lower or narrower:
                return self._canary("kept", f"canary {cand.bundle_version} would lower the version a slice holds "
                                            f"({held.bundle_version}); keeping it")
            if cand is held or (cand.checksum == held.checksum and tenants == self.candidate_tenants
                                and cand.bundle_version == held.bundle_version):
                return "unchanged"
        if tenants is not None and not tenants:
            return "none"  # not in the slice
        self._set_candidate(cand, tenants)
        return self._canary("accepted", f"canary bundle {cand.bundle_version} accepted for "
                                        + ("every request" if tenants is None else f"tenants {sorted(tenants)}"))

    def _set_candidate(self, cand: Bundle | None, tenants: frozenset[str] | None) -> None:
        held = self._candidate_snap
        snap = None if cand is None else held if held is not None and held.bundle is cand else Snapshot(cand, self.jitter)
        self.candidate, self._candidate_snap, self.candidate_tenants = cand, snap, tenants
        if self.on_canary is not None:
            self.on_canary("set", cand.bundle_version if cand is not None else 0)

    def _canary(self, outcome: str, detail: str) -> str:
        if self.on_canary is not None:
            self.on_canary(outcome, -1)
        (log.info if outcome == "accepted" else log.warning)("%s", detail)
        return outcome

    def refuse(self, detail: str, outcome: str = "invalid") -> ReloadResult:
        """A candidate refused before it could be offered (a corrupt bundle read from etcd: ``invalid``;
        one whose signature the store checked first: its signature outcome): keep the current snapshot
        and count the refusal."""
        return self._report(ReloadResult(outcome, self._snap.bundle.bundle_version, detail))

    def reload(self) -> ReloadResult:
        """Re-read the file (SIGHUP or a changed mtime)."""
        self._mtime = self._stat()
        try:
            candidate = load_bundle_file(self.path, verify=self.trusted.check)  # the signature first
        except SignatureRefused as e:
            return self._report(ReloadResult(e.outcome, self._snap.bundle.bundle_version, e.detail))
        except PolicyError as e:
            return self._report(ReloadResult("invalid", self._snap.bundle.bundle_version, e.detail))
        self.checked_at = time.monotonic()
        return self.offer(candidate)

    def poll(self) -> ReloadResult | None:
        """Reload when the file's mtime changed since the last look."""
        mtime = self._stat()
        if mtime is not None:
            self.checked_at = time.monotonic()
        if mtime == self._mtime:
            return None
        return self.reload()

    def _report(self, result: ReloadResult) -> ReloadResult:
        if self._on_reload is not None:
            self._on_reload(result)
        return result
