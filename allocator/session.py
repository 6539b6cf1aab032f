"""One etcd lease kept alive for this replica: its session (as etcd's clientv3 ``concurrency.Session``).

Every key that says "this replica is alive" — its membership key and the leader key of each
shard it leads (:mod:`allocator.election`) — is attached to the session's etcd lease, so when
the replica dies, pauses past the TTL or loses etcd, they all go at once and the other replicas
take over. The lease is granted with ``ttl_s`` seconds and kept alive every ``ttl_s / 3``.

The session is driven by its election's loop (:meth:`renew` once per round) rather than by a
task of its own, so the election sees a lost lease in the same round that loses it.

When is the lease lost: etcd says so (a keepalive answers TTL 0, or "lease not found"), or
keepalives have failed for more than half the TTL (etcd unreachable: the lease may expire any
moment, and another replica may take over). A lost lease is forgotten at once and revoked when
etcd answers again (that deletes whatever keys are still attached to it), and a new one granted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdLeaseMissing, EtcdStore

log = logging.getLogger(__name__)


class Session:
    def __init__(self, store: EtcdStore, ttl_s: int = 3, *, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.ttl_s = max(2, int(ttl_s))
        self.clock = clock
        self.etcd_lease: int | None = None  # the live etcd lease, None while there is none
        self._lost: int | None = None  # a lease given up on: revoked when etcd answers again
        self._last_refresh = 0.0  # when the last keepalive (or the grant) was sent
        self._last_ok = 0.0  # when etcd last confirmed the lease
        # the most one etcd endpoint is waited for in a keepalive (and the election's snapshot read)
        # before the next is tried: the lease lives ttl_s from the last keepalive etcd took, and the
        # next one is sent ttl_s/3 after it, so a member that stalls must be left within what is
        # left. With the whole --etcd-timeout-ms (2 s by default against a 3 s TTL) a stalled
        # member let the lease expire and moved the leadership
        self.bound_s = min(store.timeout_s, self.ttl_s / 4)

    @property
    def fresh(self) -> bool:
        """etcd confirmed the lease less than a TTL ago."""
        return self.etcd_lease is not None and self.clock() - self._last_ok <= self.ttl_s

    async def renew(self) -> int | None:
        """Once per election round: revoke a lost lease, grant one if there is none, keep it alive
        when due. The live lease, or None when etcd just said it is gone (the next call grants a
        new one). Raises ``LeaseholdError`` when etcd does not answer (then call :meth:`failed`)."""
        if self._lost is not None:
            with contextlib.suppress(EtcdLeaseMissing):
                await self.store.lease_revoke(self._lost)  # frees the keys still attached to it
            self._lost = None
        now = self.clock()
        if self.etcd_lease is None:
            self.etcd_lease = await self.store.lease_grant(self.ttl_s)
            self._last_refresh = self._last_ok = now
            return self.etcd_lease
        if now - self._last_refresh >= self.ttl_s / 3:  # retried every round until it succeeds
            try:
                ttl = await self.store.lease_keepalive(self.etcd_lease, self.bound_s)
            except EtcdLeaseMissing:
                ttl = 0
            if ttl <= 0:
                log.warning("etcd lease %x expired", self.etcd_lease)
                self.etcd_lease = None
                return None
            self._last_refresh = self._last_ok = now
        return self.etcd_lease

    def failed(self, e: LeaseholdError) -> bool:
        """An etcd call of the round failed: True when the lease is now given up on (keepalives
        failing for more than half the TTL)."""
        if self.etcd_lease is None or self.clock() - self._last_ok <= self.ttl_s / 2:
            return False
        log.warning("etcd lease %x given up: keepalives failing for %.1f s (%s)", self.etcd_lease,
                    self.clock() - self._last_ok, e.detail)
        self._lost, self.etcd_lease = self.etcd_lease, None
        return True

    async def close(self) -> None:
        """Revoke the lease: every key attached to it goes at once."""
        lease, self.etcd_lease = self.etcd_lease, None
        if lease is not None:
            with contextlib.suppress(LeaseholdError):
                await self.store.lease_revoke(lease)
