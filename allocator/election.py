"""Leadership of the allocator's shards through etcd: one election over N shards (N = 1 is the
plain deployment, one leader for every pool), in the shape of etcd's clientv3 ``concurrency``
package — a :class:`allocator.session.Session` (one etcd lease, kept alive) and this election
over it.

Each replica attaches to its session's etcd lease (keys: :mod:`allocator.records`)

* ``members/<nodeId>`` — the replica is live while its lease lives;
* the leader key of each shard it leads (``leader`` with one shard, ``leader/<shard>`` with
  more); the shard's **epoch** is that key's ``create_revision``: etcd revisions only grow, so
  every new term of a shard has a larger epoch.

Every ``poll_s`` a replica reads one consistent snapshot (``members/``, ``leader/``, ``leader``
and the shard count ``shards``, which a sharded deployment writes once and a replica of another
count refuses to campaign under) and applies :func:`allocator.shards.plan`:

* campaign for shard s: one transaction comparing ``version(leader key of s) == 0`` (sharded
  also ``value(shards) == N`` and ``version(leader) == 0``: no replica of another shard count
  can lead the same pools) and putting the key with the session's lease;
* hand off shard s (sharded only: a shard that now hashes to another live replica): stop
  accepting its writes (:meth:`require_leader` answers not-leader naming the intended owner),
  wait (bounded) until the writes already accepted are answered (``drain``, given in the
  constructor), then delete the key comparing ``create_revision == epoch``;
* a shard whose leader key is attached to this replica's lease is led by it (also after a
  campaign whose answer was lost); one whose key is gone or replaced is given up at once.

With one shard the first replica to campaign leads until it leaves or dies (no intended owner,
no handoff). When the session's lease is lost every shard is given up at once.

Fencing itself is not here: every leader write compares its shard's epoch in its own
transaction (:mod:`allocator.transactions`), so nothing here needs to be timely for safety.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from kernel.errors import LeaseholdError, NotLeader
from kernel.etcd_store import KV, EtcdRefused, TxnBuilder
from kernel.shards import SHARD_HASH, shard_of
from kernel.wire import ReplicaInfo, ShardedLeaderInfo, ShardLeader, ShardMap

from . import shards as assign
from .records import Keys, LeaderRecord, MemberRecord
from .session import Session

log = logging.getLogger(__name__)

DRAIN_S = 2.0  # at most this long for a handed-off shard's accepted writes before its key is deleted
CAMPAIGN_BATCH = 60  # shards per campaign transaction (2 more compares each: <= etcd's 128 ops)
ERROR_LOG_EVERY_S = 10.0  # at most one line per replica this often about failing election rounds

Drain = Callable[[int], Awaitable[None]]
# what the election tells its owner: "acquired" / "released" (this replica started or stopped
# leading ``shard``), "observed" (shard 0 has a new leader, whoever it is)
OnChange = Callable[[str, int, "int | None"], None]


async def _nothing_to_drain(_shard: int) -> None:
    return None


class Election:
    """This replica's leadership of the ``keys.shards`` shards of its deployment."""

    def __init__(self, session: Session, keys: Keys, *, node_id: str, url: str, drain: Drain = _nothing_to_drain,
                 on_change: OnChange | None = None, poll_s: float = 0.25, hold_s: float | None = None):
        self.session = session
        self.store = session.store
        self.keys = keys
        self.shards = keys.shards
        self.node_id = node_id
        self.url = url
        ttl_s = session.ttl_s
        self.poll_s = min(poll_s, ttl_s / 3)
        self.grace_s = float(ttl_s)  # a shard without a leader this long is taken by anyone
        self.hold_s = hold_s if hold_s is not None else 10.0 * ttl_s
        self._drain = drain
        self._on_change = on_change
        self._lease: int | None = None  # the session lease our keys are attached to
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
        self.etcd_ok = False  # the last round's etcd calls succeeded
        self.role_known = False  # the last round read who leads
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._last_error_log = -ERROR_LOG_EVERY_S

    # -- what the writer and the app ask -------------------------------------------------------
    def shard_of(self, pool: str) -> int:
        return shard_of(pool, self.shards)

    def leader_key(self, shard: int) -> bytes:
        return self.keys.leader_of(shard)

    def epoch_of(self, shard: int) -> int | None:
        """The epoch to fence with while this replica leads ``shard`` and accepts its writes."""
        return None if shard in self._draining else self._epochs.get(shard)

    def require_leader(self, shard: int = 0) -> int:
        """The epoch to fence ``shard``'s writes with, or NotLeader naming its leader (or, while
        this replica hands it off, the replica it goes to)."""
        epoch = self.epoch_of(shard)
        if epoch is not None:
            return epoch
        leader = self._leaders.get(shard)
        node, url, lepoch = (leader.node_id, leader.url, leader.epoch) if leader else (None, None, None)
        if node in (None, self.node_id):  # no leader, or ourselves handing it off: name its intended owner
            target = assign.intended_owner(shard, self.shards, self._members)
            node, url, lepoch = (target, self._members[target].url, None) if target not in (None, self.node_id) \
                else (None, None, None)
        what = "the allocator leader" if self.shards == 1 else f"shard {shard} of {self.shards}"
        extra: dict[str, object] = {"leader": url, "leaderNodeId": node, "epoch": lepoch}
        if self.shards > 1:  # (the one-shard answer keeps the shape agents knew before sharding)
            extra |= {"shard": shard, "shards": self.shards}
        raise NotLeader(f"this replica ({self.node_id}) does not lead {what}"
                        + (f"; its leader is {node} at {url}" if url else "; no leader elected yet"), extra=extra)

    def step_down(self, reason: str, shard: int | None = None) -> None:
        """Stop leading ``shard`` (every shard when None) now: a fenced write or a lost lease."""
        for s in list(self._epochs) if shard is None else [shard]:
            epoch = self._epochs.pop(s, None)
            if epoch is None:
                continue
            self._draining.discard(s)
            log.warning("node %s steps down from shard %s epoch %s: %s", self.node_id, s, epoch, reason)
            self._notify("released", s, epoch)

    @property
    def is_leader(self) -> bool:
        """Leads at least one shard and accepts its writes. Deliberately no local timing guess:
        what makes a stale leader harmless is the epoch compare in every write transaction."""
        return any(s not in self._draining for s in self._epochs)

    @property
    def led(self) -> list[int]:
        """The shards this replica leads and accepts writes for."""
        return sorted(s for s in self._epochs if s not in self._draining)

    @property
    def leader(self) -> ShardLeader:
        """Shard 0's leader as last read (with one shard: the leader)."""
        return self._leaders.get(0) or ShardLeader(shard=0, node_id=None, url=None, epoch=None)

    def leader_info(self) -> ShardedLeaderInfo:
        """``GET /v1/leader``: shard 0's leader (``isSelf``: this replica leads it with a fresh
        lease), the shard count and how many shards this replica leads."""
        lead = self.leader
        return ShardedLeaderInfo(node_id=lead.node_id, url=lead.url, epoch=lead.epoch,
                                 is_self=self.epoch_of(0) is not None and self.session.fresh,
                                 shards=self.shards, leading=len(self.led))

    def shard_map(self) -> ShardMap:
        """``GET /v1/shards``: who leads each shard, as this replica last read etcd."""
        return ShardMap(shards=self.shards, hash=SHARD_HASH, node_id=self.node_id, url=self.url,
                        revision=self._revision, members=sorted(self._members.values(), key=lambda m: m.node_id),
                        leaders=[self._leaders.get(s) or ShardLeader(shard=s, node_id=None, url=None, epoch=None)
                                 for s in range(self.shards)])

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="allocator-election")

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
        if self._epochs:
            with contextlib.suppress(TimeoutError, LeaseholdError):
                await asyncio.wait_for(asyncio.gather(*(self._drain(s) for s in list(self._epochs))), DRAIN_S)
        self.step_down("leaving")
        await self.session.close()

    def _notify(self, event: str, shard: int, epoch: int | None) -> None:
        if self._on_change is not None:
            self._on_change(event, shard, epoch)

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        """One round every ``poll_s`` until stopped. A round's etcd error marks etcd and the role
        unknown and is logged (at most every ``ERROR_LOG_EVERY_S``); a stray cancellation (a call
        cancelled under the loop) and a bug are survived, never the end of the loop."""
        while not self._stopping:
            try:
                await self._round()
                self.etcd_ok = True
            except LeaseholdError as e:
                self.etcd_ok = self.role_known = False
                self._round_failed(e)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping or task is None or task.cancelling():
                    raise  # we are being stopped
                log.warning("node %s: election round interrupted by a cancelled call; retrying", self.node_id)
                self.etcd_ok = False
            except Exception:  # noqa: BLE001 - keep the loop alive; log the bug
                log.exception("election loop error (node %s)", self.node_id)
                self.etcd_ok = False
            await asyncio.sleep(self.poll_s)

    def _round_failed(self, e: LeaseholdError) -> None:
        now = time.monotonic()
        # (a refusal is a state the etcd adapter logs once when it starts and once when it ends)
        if not isinstance(e, EtcdRefused) and now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.warning("node %s: election round failed (%s): %s", self.node_id, type(e).__name__, e.detail)
        if self.session.failed(e):
            self.step_down(f"etcd unreachable: {e.detail}")

    async def _round(self) -> None:
        lease = await self.session.renew()
        if lease != self._lease:  # lost (None) or new: nothing attached to the old one is ours
            if self._lease is not None:
                self.step_down("etcd lease lost")
            self._lease = None
            if lease is None or not await self._register(lease):
                return
            self._lease = lease
        if lease is None:
            return
        k = self.keys
        rev, (members, leaders, one, count) = await self.store.snapshot([k.members, k.leaders],
                                                                         [k.leader, k.shard_count],
                                                                         bound_s=self.session.bound_s)
        if not self._check_config(count[0] if count else None, leaders + one):
            return
        self._observe(rev, members, leaders + one)
        if self.node_id not in self._members:  # our member key vanished while the lease lives
            await self._put_member(lease)
            return
        view = assign.View(frozenset(self._members), {s: sl.node_id or "" for s, sl in self._leaders.items()})
        now = time.monotonic()
        self._orphans = assign.orphans(self._orphans, view, self.shards, now)
        p = assign.plan(self.node_id, self.shards, view, led=set(self._epochs), orphaned_since=self._orphans,
                        held_until=self._held, now=now, grace_s=self.grace_s)
        for s in p.resign - set(self._handoffs):
            self._handoffs[s] = asyncio.create_task(self._handoff(s), name=f"allocator-handoff-{s}")
        if p.campaign:
            await self._campaign(sorted(p.campaign), p.takeover, now)
        self.role_known = True

    def _check_config(self, count: KV | None, leaders: list[KV]) -> bool:
        want = str(self.shards).encode()
        other = self.keys.other_layout_leader
        if count is not None and count.value != want:
            err = (f"etcd says this deployment has {count.value.decode(errors='replace')} shards; this replica "
                   f"is configured with {self.shards} (stop every replica before changing --shards)")
        elif other is not None and any(kv.key == other for kv in leaders):
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
            s = self.keys.shard_of_leader_key(kv.key)
            if s is None:
                continue
            try:
                rec = msgspec.json.decode(kv.value, type=LeaderRecord)
                node, url = rec.node_id, rec.url
            except (msgspec.DecodeError, msgspec.ValidationError):
                node, url = None, None
            seen[s] = ShardLeader(shard=s, node_id=node, url=url, epoch=kv.create_revision)
            ours = self._lease is not None and kv.lease == self._lease
            # (a snapshot read while a handoff deleted the key may still show it: not adopted again)
            if ours and s not in self._epochs and s not in self._handoffs \
                    and self._resigned.get(s) != kv.create_revision:
                self._epochs[s] = kv.create_revision  # e.g. a campaign whose answer was lost
                log.info("node %s leads shard %s with epoch %s (found in etcd)", self.node_id, s, kv.create_revision)
                self._notify("acquired", s, kv.create_revision)
        for s, epoch in list(self._epochs.items()):
            sl = seen.get(s)
            if sl is None or sl.epoch != epoch:
                self.step_down("leader key gone or replaced", s)
        before = self._leaders.get(0)
        self._leaders = seen
        self._shard0_seen(before)

    def _shard0_seen(self, before: ShardLeader | None) -> None:
        now = self._leaders.get(0)
        if now is not None and now.epoch != (before.epoch if before else None):
            self._notify("observed", 0, now.epoch)

    async def _register(self, lease: int) -> bool:
        """Join with a new session lease: the shard count (written once), then the member key."""
        if self.keys.keeps_count:
            txn = TxnBuilder()
            txn.absent(self.keys.shard_count)
            txn.put(self.keys.shard_count, str(self.shards).encode())
            txn.get(self.keys.shard_count, failure=True)
            res = await self.store.commit(txn)
            got = res.kvs()
            if not res.succeeded and got and not self._check_config(got[0], []):
                return False
        await self._put_member(lease)
        log.info("node %s joined with etcd lease %x (%d shards)", self.node_id, lease, self.shards)
        return True

    async def _put_member(self, lease: int) -> None:
        await self.store.put(self.keys.member(self.node_id),
                             msgspec.json.encode(MemberRecord(node_id=self.node_id, url=self.url, shards=self.shards)),
                             lease)

    async def _campaign(self, shards: list[int], takeover: frozenset[int], now: float) -> None:
        assert self._lease is not None
        value = msgspec.json.encode(LeaderRecord(node_id=self.node_id, url=self.url))
        other = self.keys.other_layout_leader
        batches = [shards[i:i + CAMPAIGN_BATCH] for i in range(0, len(shards), CAMPAIGN_BATCH)]
        while batches:
            batch = batches.pop()
            txn = TxnBuilder()
            txn.absent_many(self.keys.leader_of(s) for s in batch)
            if self.keys.keeps_count:
                txn.holds(self.keys.shard_count, str(self.shards).encode())
            if other is not None:
                txn.absent(other)
            txn.put_many((self.keys.leader_of(s), value, self._lease) for s in batch)
            res = await self.store.commit(txn)
            if res.succeeded:
                epoch = res.revision  # the leader keys' create_revision
                for s in batch:
                    self._epochs[s] = epoch
                    if s in takeover:
                        self._held[s] = now + self.hold_s
                    before = self._leaders.get(s)
                    self._leaders[s] = ShardLeader(shard=s, node_id=self.node_id, url=self.url, epoch=epoch)
                    self._notify("acquired", s, epoch)
                    if s == 0:
                        self._shard0_seen(before)
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
                     assign.intended_owner(shard, self.shards, self._members))
            self._notify("released", shard, epoch)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drain(shard), DRAIN_S)
            txn = TxnBuilder()
            key = self.keys.leader_of(shard)
            txn.created_at(key, epoch)
            txn.delete(key)
            with contextlib.suppress(LeaseholdError):  # the lease expiry or the next poll settles it
                await self.store.commit(txn)
            if self._epochs.get(shard) == epoch:
                del self._epochs[shard]
            self._leaders.pop(shard, None)
        finally:
            self._draining.discard(shard)
            self._held.pop(shard, None)
            self._handoffs.pop(shard, None)
