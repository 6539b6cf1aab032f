"""The policy snapshot in force and its reload rules (seed ch. 14).

A request reads :attr:`PolicyHolder.bundle` once and is evaluated against that snapshot end
to end. A reload accepts only a valid bundle with a strictly higher ``bundleVersion`` and, when
trusted public keys are configured (``--policy-public-keys``), a signature that verifies with
one of them (``kernel.signing``); anything else keeps the current snapshot and is counted."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kernel.bundle import Bundle, load_bundle_file
from kernel.errors import PolicyError, StaleVersion
from kernel.policy_metrics import RELOAD_OUTCOMES  # noqa: F401  (re-exported: the outcomes of a reload)
from kernel.signing import SignatureRefused, TrustedKeys


@dataclass(frozen=True, slots=True)
class ReloadResult:
    outcome: str  # one of RELOAD_OUTCOMES
    version: int
    detail: str = ""


class PolicyHolder:
    def __init__(self, path: str, bundle: Bundle, *, on_reload: Callable[[ReloadResult], None] | None = None,
                 trusted: TrustedKeys | None = None):
        self.path = path
        self.trusted = trusted or TrustedKeys()
        self.trusted.check(bundle)  # the start bundle too: raises SignatureRefused
        self._bundle = bundle
        self._mtime = self._stat()
        self._on_reload = on_reload
        self.checked_at = time.monotonic()  # last successful look at the file (the snapshot age without etcd)

    @classmethod
    def load(cls, path: str, **kw) -> PolicyHolder:
        """Load at start; raises PolicyError (listing every problem) on an invalid bundle, or
        SignatureRefused when keys are trusted and the bundle's signature is not acceptable."""
        return cls(path, load_bundle_file(path), **kw)

    @property
    def bundle(self) -> Bundle:
        return self._bundle

    def _stat(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def offer(self, candidate: Bundle) -> ReloadResult:
        """Swap to ``candidate`` if its signature is acceptable and its version strictly higher
        (it is already validated)."""
        current = self._bundle
        try:
            self.trusted.check(candidate)
        except SignatureRefused as e:
            return self._report(ReloadResult(e.outcome, current.bundle_version, e.detail))
        if candidate.bundle_version <= current.bundle_version:
            err = StaleVersion(f"bundle {candidate.bundle_version} is not newer than {current.bundle_version}")
            return self._report(ReloadResult("stale", current.bundle_version, err.detail))
        self._bundle = candidate  # one reference assignment: readers see old or new, never a mix
        return self._report(ReloadResult("accepted", candidate.bundle_version))

    def refuse_invalid(self, detail: str) -> ReloadResult:
        """A candidate that failed validation (e.g. a corrupt bundle read from etcd): keep the
        current snapshot and count the refusal."""
        return self._report(ReloadResult("invalid", self._bundle.bundle_version, detail))

    def reload(self) -> ReloadResult:
        """Re-read the file (SIGHUP or a changed mtime)."""
        self._mtime = self._stat()
        try:
            candidate = load_bundle_file(self.path)
        except PolicyError as e:
            return self._report(ReloadResult("invalid", self._bundle.bundle_version, e.detail))
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
