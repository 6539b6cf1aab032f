"""Leader election through one etcd key, and the epoch that fences every leader write.

The leader key (``<prefix>leader``) is created with a ``version == 0`` compare and attached to
an etcd lease of ``ttl_s`` seconds; a keepalive task refreshes the lease every ``ttl_s / 3``.
The epoch is the key's ``create_revision``: etcd revisions only grow, so every new election
has a larger epoch. On a failed keepalive, a lost lease or a keepalive older than the TTL
the leader steps down at once. Followers poll the key and campaign when it is gone.

Fencing itself is not here: every leader write carries
``create_revision(leader key) == epoch`` in its own transaction (see ``allocator.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kernel.errors import LeaseholdError, NotLeader
from kernel.etcd_store import EtcdLeaseMissing, EtcdStore, range_kvs, txn_revision
from kernel.wire import LeaderInfo

log = logging.getLogger("allocator.election")
ERROR_LOG_EVERY_S = 10.0  # at most one line per node this often about failing election rounds


class LeaderRecord(msgspec.Struct, rename="camel"):
    node_id: str
    url: str



class RoundFailures:
    """How an election loop reports its failing rounds (both elections use it): a failed round at
    most once per ``ERROR_LOG_EVERY_S`` (a leaderless spell must show in the log without flooding
    it), and whether a ``CancelledError`` is the loop's own stop or a driver's call cancelled under
    it (which the loop must outlive, or the node never campaigns again)."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._last_log = -ERROR_LOG_EVERY_S

    def failed(self, e: LeaseholdError) -> None:
        now = time.monotonic()
        if now - self._last_log >= ERROR_LOG_EVERY_S:
            self._last_log = now
            log.warning("node %s: election round failed (%s): %s", self.node_id, type(e).__name__, e.detail)

    def interrupted(self, stopping: bool) -> bool:
        """True: a stray cancellation, logged (carry on); False: our own stop (re-raise)."""
        task = asyncio.current_task()
        if stopping or task is None or task.cancelling():
            return False
        log.warning("node %s: election round interrupted by a cancelled call; retrying", self.node_id)
        return True



async def run_rounds(node: Any, round_: Callable[[], Awaitable[None]], failed: Callable[[LeaseholdError], None],
                     pause_s: Callable[[], float]) -> None:
    """The loop both elections run until ``node._stopping``: one round, then a pause. A round's
    etcd error marks the node's etcd and role unknown, is logged (``RoundFailures``) and handed to
    ``failed``; a stray cancellation and a bug are survived (logged), never the end of the loop."""
    while not node._stopping:
        try:
            await round_()
            node.etcd_ok = True
        except LeaseholdError as e:
            node.etcd_ok = False
            node.role_known = False
            node._rounds.failed(e)
            failed(e)
        except asyncio.CancelledError:
            if not node._rounds.interrupted(node._stopping):
                raise  # we are being stopped
            node.etcd_ok = False
        except Exception:  # noqa: BLE001 - keep the loop alive; log the bug
            log.exception("election loop error (node %s)", node.node_id)
            node.etcd_ok = False
        await asyncio.sleep(pause_s())


class Election:
    def __init__(self, store: EtcdStore, key: bytes, *, node_id: str, url: str, ttl_s: int = 3,
                 on_change: Callable[[bool, int | None], None] | None = None):
        self.store = store
        self.key = key
        self.node_id = node_id
        self.url = url
        self.ttl_s = max(2, int(ttl_s))
        self._on_change = on_change
        self._lease_id: int | None = None
        self._stale_lease: int | None = None  # a lease we lost track of: revoke it when etcd is back
        self._epoch: int | None = None  # set only while we lead
        self._last_ok = 0.0  # monotonic time of the last successful keepalive/campaign
        self.leader: LeaderInfo = LeaderInfo(node_id=None, url=None, epoch=None)
        self.etcd_ok = False  # the last etcd call succeeded
        self.role_known = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._rounds = RoundFailures(node_id)
        self.leader_changed = asyncio.Event()

    # -- state ----------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """We won an election and have not stepped down. Deliberately no local timing guess:
        what makes a stale leader harmless is the epoch compare in every write transaction
        (a leader resumed after a pause tries, fails that compare and steps down)."""
        return self._epoch is not None

    @property
    def lease_fresh(self) -> bool:
        """The last keepalive is younger than the TTL (reported by /v1/leader and /readyz)."""
        return self._epoch is not None and time.monotonic() - self._last_ok <= self.ttl_s

    @property
    def epoch(self) -> int | None:
        return self._epoch if self.is_leader else None

    # -- the shard surface (one shard: every pool, fenced by this one key) -------------------------
    shards = 1

    def shard_of(self, pool: str) -> int:
        return 0

    def leader_key(self, shard: int = 0) -> bytes:
        return self.key

    def epoch_of(self, shard: int = 0) -> int | None:
        return self.epoch

    def require_leader(self, shard: int = 0) -> int:
        """The epoch to fence writes with, or NotLeader naming the leader."""
        epoch = self.epoch
        if epoch is None:
            info = self.leader
            raise NotLeader(
                f"this replica ({self.node_id}) is not the allocator leader"
                + (f"; the leader is {info.node_id} at {info.url}" if info.url else "; no leader elected yet"),
                extra={"leader": info.url, "leaderNodeId": info.node_id, "epoch": info.epoch})
        return epoch

    def info(self) -> LeaderInfo:
        return LeaderInfo(node_id=self.leader.node_id, url=self.leader.url, epoch=self.leader.epoch,
                          is_self=self.lease_fresh)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="allocator-election")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._epoch is not None:
            await self._resign()

    def step_down(self, reason: str, shard: int | None = None) -> None:
        """Stop leading now (called on a fenced write or a failed keepalive)."""
        if self._epoch is None:
            return
        log.warning("node %s steps down from epoch %s: %s", self.node_id, self._epoch, reason)
        self._epoch = None
        self.leader = LeaderInfo(node_id=None, url=None, epoch=None)
        self._notify()

    def _notify(self) -> None:
        self.leader_changed.set()
        self.leader_changed = asyncio.Event()
        if self._on_change is not None:
            self._on_change(self._epoch is not None, self._epoch)

    async def _resign(self) -> None:
        lid, self._lease_id = self._lease_id, None
        self.step_down("resigning")
        if lid is not None:
            with contextlib.suppress(LeaseholdError):
                await self.store.revoke(lid)  # deletes our leader key: the others campaign at once

    # -- loop -------------------------------------------------------------------------------------
    async def _run(self) -> None:
        interval = self.ttl_s / 3
        await run_rounds(self, self._round, self._round_failed,
                         lambda: interval if self._epoch is not None else min(interval, 0.5))

    async def _round(self) -> None:
        if self._epoch is not None:
            await self._keepalive()
        else:
            await self._observe_or_campaign()

    def _round_failed(self, e: LeaseholdError) -> None:
        if self._epoch is not None:
            self.step_down(f"etcd error during keepalive: {e.detail}")
            self._stale_lease, self._lease_id = self._lease_id, None

    async def _keepalive(self) -> None:
        assert self._lease_id is not None
        ttl = await self.store.refresh(self._lease_id)
        if ttl <= 0:
            self._lease_id = None
            self.step_down("leader lease expired")
            return
        if time.monotonic() - self._last_ok > self.ttl_s:
            # we were paused past the TTL: even if the lease survived, re-check the key
            kv = await self.store.get(self.key)
            if kv is None or kv.create_revision != self._epoch:
                self._lease_id = None
                self.step_down("leader key replaced while paused")
                return
        self._last_ok = time.monotonic()
        self.role_known = True

    async def _observe_or_campaign(self) -> None:
        if self._stale_lease is not None:
            with contextlib.suppress(EtcdLeaseMissing):
                await self.store.revoke(self._stale_lease)  # frees our old leader key, if still there
            self._stale_lease = None
        kv = await self.store.get(self.key)
        if kv is not None:
            self._set_leader(kv.value, kv.create_revision)
            self.role_known = True
            return
        lease_id = await self.store.lease(self.ttl_s)
        value = msgspec.json.encode(LeaderRecord(node_id=self.node_id, url=self.url))
        t = self.store.t
        ok, responses = await self.store.txn(
            [t.version(self.key) == 0], [t.put(self.key, value, lease=lease_id)], [t.get(self.key)])
        if not ok:
            with contextlib.suppress(LeaseholdError):
                await self.store.revoke(lease_id)
            kvs = range_kvs(responses[0]) if responses else []
            if kvs:
                self._set_leader(kvs[0].value, kvs[0].create_revision)
            self.role_known = bool(kvs)
            return
        self._lease_id = lease_id
        self._epoch = txn_revision(responses)
        self._last_ok = time.monotonic()
        self.leader = LeaderInfo(node_id=self.node_id, url=self.url, epoch=self._epoch)
        self.role_known = True
        log.info("node %s leads with epoch %s", self.node_id, self._epoch)
        self._notify()

    def _set_leader(self, raw: bytes, epoch: int) -> None:
        try:
            rec = msgspec.json.decode(raw, type=LeaderRecord)
            node, url = rec.node_id, rec.url
        except msgspec.DecodeError:
            node, url = None, None
        if self.leader.epoch != epoch:
            self.leader = LeaderInfo(node_id=node, url=url, epoch=epoch)
            self._notify()
