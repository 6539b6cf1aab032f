"""Follow the policy key in etcd: an etcd watch for prompt switches, plus a periodic re-read
as the safety net (a lost watch, a compaction, a reconnect) and as the freshness signal.

The watcher never decides what to do with a bundle: it hands each newly seen, valid bundle to
``offer`` (which accepts only strictly higher versions) and each refused one to ``refuse``, with
the store's reason and outcome (``invalid``; with trusted keys, a signature outcome, which the
store checks before the validation: ``kernel.policy_store.Stored``).
``last_ok`` is the monotonic time of the last successful etcd read; :meth:`age_ms` is what
the bundle's ``maxAgeMs`` is compared with (I13). Before the first successful read the age
counts from the watcher's creation (process start), so an agent that never reaches etcd
goes stale on schedule too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kernel.bundle import Bundle
from kernel.errors import LeaseholdError

from .etcd_store import abandon_after
from .policy_store import PolicyStore
from .ratelog import TransitionLog

log = logging.getLogger(__name__)


READS_LOG_EVERY_S = 10.0


def _read_line(state: object, changes: int) -> tuple[int, str]:
    more = f" ({changes} changes since the last line)" if changes > 1 else ""
    if state == "ok":
        return logging.WARNING, f"policy read from etcd again{more}"
    return logging.WARNING, f"policy read from etcd failed ({state}); keeping the current bundle until it answers{more}"


class PolicyWatcher:
    def __init__(self, store: PolicyStore, *, offer: Callable[[Bundle], Any], refuse: Callable[[str, str], Any],
                 reread_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 offer_canary: Callable[[Any], Any] | None = None):
        self.store = store
        self.offer = offer
        # agents: the canary key too, read in the same transaction as the policy key (one revision),
        # and handed on after the current bundle (docs/policy.md, "Canary release")
        self.offer_canary = offer_canary
        self.refuse = refuse
        self.reread_s = reread_s
        self.clock = clock
        self.last_ok = clock()
        self.reads_ok = 0
        self.reads_failed = 0
        self.watch_events = 0  # events the watch delivered (each triggers a read): the watch is live
        self._seen_revision = (0, 0)  # mod_revisions of the policy and canary values last handed on
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        # one line when reads start failing (or fail for another reason) and one when they succeed
        # again, at most one per READS_LOG_EVERY_S: a line per failed read was one every re-read
        # (and watch reconnect) for the whole of an etcd outage
        self._reads = TransitionLog(log, initial="ok", interval_s=READS_LOG_EVERY_S, clock=time.monotonic)

    # -- one read -------------------------------------------------------------------------------
    async def refresh(self) -> bool:
        """Read the key once; hand a value not seen before to ``offer``/``refuse``.
        Returns False when etcd could not be read (the current bundle stays in force)."""
        async with self._lock:
            try:
                if self.offer_canary is not None:
                    stored, canary = await self.store.read_both()
                else:
                    stored, canary = await self.store.read(), None
            except LeaseholdError as e:
                self.reads_failed += 1
                self._reads.observe(e.code, _read_line)
                return False
            self._reads.observe("ok", _read_line)
            self.last_ok = self.clock()
            self.reads_ok += 1
            seen = (stored.mod_revision if stored else 0, canary.mod_revision if canary else 0)
            if stored is None and canary is None or seen == self._seen_revision:
                return True
            changed = stored is not None and stored.mod_revision != self._seen_revision[0]
            self._seen_revision = seen
            if changed and stored is not None:
                if stored.bundle is None:
                    self.refuse(stored.problem, stored.outcome)
                else:
                    self.offer(stored.bundle)
            if self.offer_canary is not None:
                self.offer_canary(canary)
            return True

    def age_ms(self) -> float:
        return (self.clock() - self.last_ok) * 1000.0

    def is_stale(self, bundle: Bundle) -> bool:
        """True when the bundle has a ``maxAgeMs`` and etcd was not read successfully for longer."""
        return bundle.max_age_ms is not None and self.age_ms() > bundle.max_age_ms

    # -- background -----------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._reread_loop()), asyncio.create_task(self._watch_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _reread_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reread_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("policy re-read failed")

    async def _watch_loop(self) -> None:
        """Each watch event triggers a read (the read, not the event, is what is applied, so a
        missed or coalesced event cannot leave an older value in force)."""
        backoff = 0.2
        while True:
            watch = None
            try:
                watch = await self.store.watch(with_canary=self.offer_canary is not None)
                backoff = 0.2
                await self.refresh()  # anything written before the watch was registered
                async for _event in watch:
                    self.watch_events += 1
                    await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - driver errors: reconnect after a pause
                log.debug("policy watch interrupted (%s); re-establishing", type(e).__name__)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await abandon_after(watch.cancel(), 0.5)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.reread_s)
