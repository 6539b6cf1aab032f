"""Shards of leadership through etcd: membership, one leader key per shard, handoff.

Each replica holds one etcd lease of ``ttl_s`` seconds (a keepalive every ``ttl_s / 3``) and
attaches to it

* ``<prefix>members/<nodeId>`` — ``{"nodeId", "url", "shards"}``: the replica is live while its
  lease lives;
* ``<prefix>leader/<shard>`` — ``{"nodeId", "url"}`` for each shard it leads; the shard's epoch
  is this key's ``create_revision``.

A replica that dies (SIGKILL, etcd unreachable, paused past its TTL) therefore loses its
membership and every shard at once when its lease expires, and the others take over.

Every ``poll_s`` a replica reads one consistent snapshot (``members/``, ``leader/``, the
deployment's shard count ``<prefix>shards`` and the unsharded leader key ``<prefix>leader``)
and applies :func:`allocator.shards.plan`:

* campaign for shard s: one transaction comparing ``version(leader/s) == 0``,
  ``value(<prefix>shards) == N`` and ``version(<prefix>leader) == 0`` (no replica of another
  shard count, and no unsharded leader, can lead the same pools) and putting the key with this
  replica's lease;
* hand off shard s: stop accepting its writes (``require_leader`` answers not-leader naming the
  intended owner), wait (bounded) for the writes already accepted to finish or fail on the epoch
  compare (``drain``), then delete the key comparing ``create_revision == epoch``; the new owner
  campaigns at its next poll and starts from etcd.

A shard whose leader key is attached to this replica's lease is led by it (also after an
ambiguous campaign whose answer was lost). Fencing itself is not here: every leader write
compares its shard's epoch in its own transaction (``allocator.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from kernel.errors import LeaseholdError, NotLeader
from kernel.etcd_store import KV, EtcdLeaseMissing, EtcdStore, range_kvs, txn_revision
from kernel.shards import SHARD_HASH, shard_of
from kernel.wire import LeaderInfo, ReplicaInfo, ShardLeader, ShardMap

from . import shards as assign
from .election import LeaderRecord, RoundFailures, run_rounds

log = logging.getLogger("allocator.shards")

DRAIN_S = 2.0  # at most this long for a handed-off shard's accepted writes before its key is deleted
CAMPAIGN_BATCH = 60  # shards per campaign transaction (2 more compares each: <= MAX_TXN_OPS)


class MemberRecord(msgspec.Struct, rename="camel"):
    node_id: str
    url: str
    shards: int


class ShardKeys:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.members = f"{prefix}members/".encode()
        self.leaders = f"{prefix}leader/".encode()
        self.config = f"{prefix}shards".encode()
        self.unsharded = f"{prefix}leader".encode()

    def member(self, node_id: str) -> bytes:
        return self.members + node_id.encode()

    def leader(self, shard: int) -> bytes:
        return self.leaders + str(shard).encode()


class ShardElection:
    """Leadership of ``shards`` shards for one replica (the sharded counterpart of
    :class:`allocator.election.Election`, with the same surface for the engine and the app)."""

    def __init__(self, store: EtcdStore, prefix: str, *, shards: int, node_id: str, url: str, ttl_s: int = 3,
                 poll_s: float = 0.25, hold_s: float | None = None,
                 on_change: Callable[[int, bool, int | None], None] | None = None):
        if shards < 2:
            raise ValueError("a sharded election needs at least 2 shards (1 is allocator.election.Election)")
        self.store = store
        self.keys = ShardKeys(prefix)
        self.shards = shards
        self.node_id = node_id
        self.url = url
        self.ttl_s = max(2, int(ttl_s))
        self.poll_s = min(poll_s, self.ttl_s / 3)
        self.grace_s = float(self.ttl_s)  # a shard without a leader this long is taken by anyone
        self.hold_s = hold_s if hold_s is not None else 10.0 * self.ttl_s
        self._on_change = on_change
        self.drain: Callable[[int], Awaitable[None]] | None = None  # set by the engine's owner
        self._lease_id: int | None = None
        self._stale_lease: int | None = None  # a lease we lost track of: revoke it when etcd is back
        self._last_refresh = 0.0
        self._last_ok = 0.0  # monotonic time of the last successful keepalive/registration
        self._epochs: dict[int, int] = {}  # shards this replica leads (accepting or draining) -> epoch
        self._draining: set[int] = set()
        self._handoffs: dict[int, asyncio.Task[None]] = {}
        self._resigned: dict[int, int] = {}  # shard -> the epoch we last handed off (never adopted again)
        self._orphans: dict[int, float] = {}
        self._held: dict[int, float] = {}
        self._members: dict[str, ReplicaInfo] = {}
        self._leaders: dict[int, ShardLeader] = {}
        self._revision = 0
        self.config_error: str | None = None
        self.etcd_ok = False
        self.role_known = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._rounds = RoundFailures(node_id)
        self.leader_changed = asyncio.Event()

    # -- the surface the engine and the app use ------------------------------------------------
    def shard_of(self, pool: str) -> int:
        return shard_of(pool, self.shards)

    def leader_key(self, shard: int) -> bytes:
        return self.keys.leader(shard)

    def epoch_of(self, shard: int) -> int | None:
        """The epoch to fence with while this replica leads ``shard`` and accepts its writes."""
        return None if shard in self._draining else self._epochs.get(shard)

    def require_leader(self, shard: int = 0) -> int:
        epoch = self.epoch_of(shard)
        if epoch is not None:
            return epoch
        leader = self._leaders.get(shard)
        node, url, lepoch = (leader.node_id, leader.url, leader.epoch) if leader else (None, None, None)
        if node in (None, self.node_id):  # no leader, or ourselves handing it off: name its intended owner
            target = assign.owner(shard, self._members)
            node, url, lepoch = (target, self._members[target].url, None) if target not in (None, self.node_id) \
                else (None, None, None)
        raise NotLeader(
            f"this replica ({self.node_id}) does not lead shard {shard} of {self.shards}"
            + (f"; its leader is {node} at {url}" if url else "; its election is under way"),
            extra={"leader": url, "leaderNodeId": node, "epoch": lepoch, "shard": shard, "shards": self.shards})

    def step_down(self, reason: str, shard: int | None = None) -> None:
        """Stop leading ``shard`` (every shard when None) now: a fenced write or a lost lease."""
        for s in list(self._epochs) if shard is None else [shard]:
            epoch = self._epochs.pop(s, None)
            if epoch is None:
                continue
            self._draining.discard(s)
            log.warning("node %s steps down from shard %s epoch %s: %s", self.node_id, s, epoch, reason)
            self._notify(s, False, epoch)

    @property
    def is_leader(self) -> bool:
        """Leads at least one shard (and accepts its writes)."""
        return any(s not in self._draining for s in self._epochs)

    @property
    def led(self) -> list[int]:
        return sorted(s for s in self._epochs if s not in self._draining)

    @property
    def lease_fresh(self) -> bool:
        return self._lease_id is not None and time.monotonic() - self._last_ok <= self.ttl_s

    @property
    def epoch(self) -> int | None:
        return self.epoch_of(0)

    @property
    def leader(self) -> LeaderInfo:
        """Shard 0's leader (what ``/v1/leader`` reports for a sharded deployment)."""
        sl = self._leaders.get(0)
        return LeaderInfo(node_id=sl.node_id, url=sl.url, epoch=sl.epoch) if sl else \
            LeaderInfo(node_id=None, url=None, epoch=None)

    def info(self) -> LeaderInfo:
        lead = self.leader
        return LeaderInfo(node_id=lead.node_id, url=lead.url, epoch=lead.epoch,
                          is_self=self.epoch_of(0) is not None and self.lease_fresh)

    def shard_map(self) -> ShardMap:
        return ShardMap(shards=self.shards, hash=SHARD_HASH, node_id=self.node_id, url=self.url,
                        revision=self._revision, members=sorted(self._members.values(), key=lambda m: m.node_id),
                        leaders=[self._leaders.get(s) or ShardLeader(shard=s, node_id=None, url=None, epoch=None)
                                 for s in range(self.shards)])

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="allocator-shard-election")

    async def stop(self) -> None:
        """Leave: stop accepting every shard, let accepted writes finish (bounded), then revoke
        the lease — membership and every leader key go at once and the others take over."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for t in self._handoffs.values():
            t.cancel()
        self._draining |= set(self._epochs)
        if self._epochs and self.drain is not None:
            with contextlib.suppress(TimeoutError, LeaseholdError):
                await asyncio.wait_for(asyncio.gather(*(self.drain(s) for s in list(self._epochs))), DRAIN_S)
        self.step_down("leaving")
        lid, self._lease_id = self._lease_id, None
        if lid is not None:
            with contextlib.suppress(LeaseholdError):
                await self.store.revoke(lid)

    def _notify(self, shard: int, leading: bool, epoch: int | None) -> None:
        self.leader_changed.set()
        self.leader_changed = asyncio.Event()
        if self._on_change is not None:
            self._on_change(shard, leading, epoch)

    # -- loop -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        await run_rounds(self, self._tick, self._round_failed, lambda: self.poll_s)

    def _round_failed(self, e: LeaseholdError) -> None:
        if self._lease_id is not None and time.monotonic() - self._last_ok > self.ttl_s / 2:
            # keepalives failing for half the TTL: the lease may expire any moment
            self.step_down(f"etcd unreachable: {e.detail}")
            self._stale_lease, self._lease_id = self._lease_id, None

    async def _tick(self) -> None:
        if self._stale_lease is not None:
            with contextlib.suppress(EtcdLeaseMissing):
                await self.store.revoke(self._stale_lease)  # frees our old keys, if still there
            self._stale_lease = None
        now = time.monotonic()
        if self._lease_id is None:
            if not await self._register():
                return
        elif now - self._last_refresh >= self.ttl_s / 3:  # retried every poll until it succeeds
            try:
                ttl = await self.store.refresh(self._lease_id)
            except EtcdLeaseMissing:
                ttl = 0
            if ttl <= 0:
                self._lease_id = None
                self.step_down("lease expired")
                return
            self._last_refresh = self._last_ok = now
        rev, (members, leaders, config, unsharded) = await self.store.read_prefixes(
            [self.keys.members, self.keys.leaders], [self.keys.config, self.keys.unsharded])
        if not self._check_config(config[0] if config else None, bool(unsharded)):
            return
        self._observe(rev, members, leaders)
        if self.node_id not in self._members:  # our member key vanished while the lease lives
            await self._put_member()
            return
        view = assign.View(frozenset(self._members), {s: sl.node_id or "" for s, sl in self._leaders.items()})
        self._orphans = assign.orphans(self._orphans, view, self.shards, now)
        p = assign.plan(self.node_id, self.shards, view, led=set(self._epochs), orphaned_since=self._orphans,
                        held_until=self._held, now=now, grace_s=self.grace_s)
        for s in p.resign - set(self._handoffs):
            self._handoffs[s] = asyncio.create_task(self._handoff(s), name=f"allocator-handoff-{s}")
        if p.campaign:
            await self._campaign(sorted(p.campaign), p.takeover, now)
        self.role_known = True

    def _check_config(self, config: KV | None, unsharded_leader: bool) -> bool:
        want = str(self.shards).encode()
        if config is not None and config.value != want:
            err = (f"etcd says this deployment has {config.value.decode(errors='replace')} shards; this replica "
                   f"is configured with {self.shards} (stop every replica before changing --shards)")
        elif unsharded_leader:
            err = "an unsharded allocator (--shards 1) leads this prefix; not campaigning"
        else:
            err = None
        if err != self.config_error:
            if err:
                log.error("%s", err)
            self.config_error = err
        return err is None

    def _observe(self, rev: int, members: list[KV], leaders: list[KV]) -> None:
        self._revision = rev
        self._members = {}
        for kv in members:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                m = msgspec.json.decode(kv.value, type=MemberRecord)
                if m.shards == self.shards:  # a replica of another shard count is not a candidate
                    self._members[m.node_id] = ReplicaInfo(node_id=m.node_id, url=m.url)
        seen: dict[int, ShardLeader] = {}
        for kv in leaders:
            tail = kv.key[len(self.keys.leaders):]
            if not tail.isdigit() or int(tail) >= self.shards:
                continue
            s = int(tail)
            try:
                rec = msgspec.json.decode(kv.value, type=LeaderRecord)
                node, url = rec.node_id, rec.url
            except (msgspec.DecodeError, msgspec.ValidationError):
                node, url = None, None
            seen[s] = ShardLeader(shard=s, node_id=node, url=url, epoch=kv.create_revision)
            ours = self._lease_id is not None and kv.lease == self._lease_id
            # (a snapshot read while a handoff deleted the key may still show it: not adopted again)
            if ours and s not in self._epochs and s not in self._handoffs \
                    and self._resigned.get(s) != kv.create_revision:
                self._epochs[s] = kv.create_revision  # e.g. a campaign whose answer was lost
                log.info("node %s leads shard %s with epoch %s (found in etcd)", self.node_id, s, kv.create_revision)
                self._notify(s, True, kv.create_revision)
        for s, epoch in list(self._epochs.items()):
            sl = seen.get(s)
            if sl is None or sl.epoch != epoch:
                self.step_down("leader key gone or replaced", s)
        self._leaders = seen

    async def _register(self) -> bool:
        t = self.store.t
        ok, responses = await self.store.txn([t.version(self.keys.config) == 0],
                                             [t.put(self.keys.config, str(self.shards).encode())],
                                             [t.get(self.keys.config)])
        if not ok:
            got = range_kvs(responses[0]) if responses else []
            if got and not self._check_config(got[0], False):
                return False
        self._lease_id = await self.store.lease(self.ttl_s)
        self._last_refresh = self._last_ok = time.monotonic()
        await self._put_member()
        log.info("node %s joined with lease %x (%d shards)", self.node_id, self._lease_id, self.shards)
        return True

    async def _put_member(self) -> None:
        assert self._lease_id is not None
        rec = MemberRecord(node_id=self.node_id, url=self.url, shards=self.shards)
        t = self.store.t
        await self.store.txn([], [t.put(self.keys.member(self.node_id), msgspec.json.encode(rec),
                                         lease=self._lease_id)])

    async def _campaign(self, shards: list[int], takeover: frozenset[int], now: float) -> None:
        assert self._lease_id is not None
        t = self.store.t
        value = msgspec.json.encode(LeaderRecord(node_id=self.node_id, url=self.url))
        guard = [t.value(self.keys.config) == str(self.shards).encode(), t.version(self.keys.unsharded) == 0]
        batches = [shards[i:i + CAMPAIGN_BATCH] for i in range(0, len(shards), CAMPAIGN_BATCH)]
        while batches:
            batch = batches.pop()
            ok, responses = await self.store.txn(
                [*(t.version(self.keys.leader(s)) == 0 for s in batch), *guard],
                [t.put(self.keys.leader(s), value, lease=self._lease_id) for s in batch], [])
            if ok:
                epoch = txn_revision(responses)
                for s in batch:
                    self._epochs[s] = epoch
                    if s in takeover:
                        self._held[s] = now + self.hold_s
                    self._leaders[s] = ShardLeader(shard=s, node_id=self.node_id, url=self.url, epoch=epoch)
                    self._notify(s, True, epoch)
                log.info("node %s leads shards %s with epoch %s", self.node_id, batch, epoch)
            elif len(batch) > 1:  # somebody took one of them: try each on its own
                batches += [[s] for s in batch]

    async def _handoff(self, shard: int) -> None:
        """Stop accepting, drain, delete the key (fenced by the epoch)."""
        try:
            epoch = self._epochs.get(shard)
            if epoch is None:
                return
            self._draining.add(shard)
            self._resigned[shard] = epoch
            log.info("node %s hands shard %s (epoch %s) off to %s", self.node_id, shard, epoch,
                     assign.owner(shard, self._members))
            self._notify(shard, False, epoch)
            if self.drain is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.drain(shard), DRAIN_S)
            t = self.store.t
            key = self.keys.leader(shard)
            with contextlib.suppress(LeaseholdError):  # the lease expiry or the next poll settles it
                await self.store.txn([t.create(key) == epoch], [t.delete(key)], [])
            if self._epochs.get(shard) == epoch:
                del self._epochs[shard]
            self._leaders.pop(shard, None)
        finally:
            self._draining.discard(shard)
            self._held.pop(shard, None)
            self._handoffs.pop(shard, None)
