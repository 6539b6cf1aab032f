"""Read the allocator's own records back from etcd after a run, as history records.

Adapter: uses the allocator's etcd client and key layout (``<prefix>grants/<region>/<leaseId>``,
``<prefix>pools/<pool>/<k>``, ``<prefix>leader`` or, sharded, ``<prefix>leader/<shard>``) and
its stored types, so the checker judges
exactly what the allocator committed. A grant's commit revision is its record's
``create_revision``: a later usage report rewrites the record (new mod_revision) under the
then-current leader, which says nothing about when the grant itself committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import msgspec

from allocator.allocation import WindowState
from allocator.records import GrantRecord, Keys, LeaderRecord
from kernel.errors import LeaseholdError
from kernel.etcd_store import EtcdStore

from .history import EtcdGrant, EtcdWindow, HistoryError, Leader, now_ms

log = logging.getLogger(__name__)


def grant_from_kv(value: bytes, create_revision: int, mod_revision: int, key: bytes = b"") -> EtcdGrant:
    try:
        rec = msgspec.json.decode(value, type=GrantRecord)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HistoryError(f"etcd grant record {key.decode(errors='replace')} is unreadable: {e}") from None
    g = rec.grant
    return EtcdGrant(lease_id=g.lease_id, pool=g.pool, region=g.region, granted=g.granted,
                     window_index=g.window.index, epoch=g.epoch, expires_at_ms=g.expires_at_ms,
                     mod_revision=create_revision, create_revision=create_revision,
                     spent=rec.spent if rec.reported else None, returned=rec.returned)


def leader_from_kv(value: bytes, create_revision: int, shard: int = 0) -> Leader:
    try:
        node = msgspec.json.decode(value, type=LeaderRecord).node_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        node = None
    return Leader(epoch=create_revision, node=node, observed_at_ms=now_ms(), shard=shard)


async def read_leaders(store: EtcdStore, prefix: str = "/leasehold/") -> list[Leader]:
    """The current leader of every shard of allocator leadership (unsharded: the one leader), in
    one etcd snapshot; empty while no leader is elected."""
    _rev, (sharded, single) = await store.snapshot([f"{prefix}leader/".encode()], [Keys(prefix).leader])
    out = [leader_from_kv(kv.value, kv.create_revision) for kv in single]
    for kv in sharded:
        tail = kv.key.rsplit(b"/", 1)[1]
        if tail.isdigit():
            out.append(leader_from_kv(kv.value, kv.create_revision, int(tail)))
    return out


def window_from_kv(value: bytes, mod_revision: int, key: bytes = b"") -> EtcdWindow:
    try:
        w = msgspec.json.decode(value, type=WindowState)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise HistoryError(f"etcd window record {key.decode(errors='replace')} is unreadable: {e}") from None
    return EtcdWindow(pool=w.pool, window_index=w.index, limit=w.limit, remaining=w.remaining,
                      granted=w.total_granted, returned=w.total_returned, mod_revision=mod_revision)


async def _read_records(store: EtcdStore, prefix: str) -> list[EtcdGrant | EtcdWindow]:
    out: list[EtcdGrant | EtcdWindow] = []
    for kv in await store.get_prefix(Keys(prefix).grants):
        # mod_revision of the record is not the grant's commit: see the module docstring
        out.append(grant_from_kv(kv.value, kv.create_revision, kv.mod_revision, kv.key))
    for kv in await store.get_prefix(f"{prefix}pools/".encode()):
        out.append(window_from_kv(kv.value, kv.mod_revision, kv.key))
    return out


def _record_key(r: EtcdGrant | EtcdWindow) -> tuple:
    return ("grant", r.lease_id) if isinstance(r, EtcdGrant) else ("window", r.pool, r.window_index)


class RecordKeeper:
    """Grant and window records read during the run, so that those gone by the end count too.

    The allocator's records expire a while after their window (its ``record_expiry_ms``: the
    window's end plus at least 60 s), so a run longer than that loses its first windows' records
    before :func:`read_back`: the checker would then find grants a region received "not in etcd".
    The keeper reads every ``every_s`` (well under that linger, so it sees each record's last
    state: usage reports land within seconds of a window's end) and keeps the latest version of
    each record; :func:`read_back` adds those no longer in etcd. A read that fails (a fault on
    etcd) is skipped: the next one, or the final read, covers it."""

    def __init__(self, endpoints: str | Sequence[str], prefix: str = "/leasehold/", *, every_s: float = 15.0,
                 timeout_s: float = 5.0):
        self.endpoints, self.prefix, self.every_s, self.timeout_s = endpoints, prefix, every_s, timeout_s
        self.seen: dict[tuple, EtcdGrant | EtcdWindow] = {}
        self.reads = 0

    def keep(self, records: Iterable[EtcdGrant | EtcdWindow]) -> None:
        for r in records:
            self.seen[_record_key(r)] = r

    async def read_once(self) -> None:
        store = EtcdStore(self.endpoints, timeout_s=self.timeout_s)
        try:
            self.keep(await _read_records(store, self.prefix))
            self.reads += 1
        finally:
            await store.close()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)
                return
            try:
                await self.read_once()
            except (LeaseholdError, OSError) as e:
                log.info("reading etcd's records during the run failed (the next read covers it): %s", e)

    def gone(self, current: Iterable[EtcdGrant | EtcdWindow]) -> list[EtcdGrant | EtcdWindow]:
        """The kept records not among ``current`` (expired from etcd since they were read)."""
        have = {_record_key(r) for r in current}
        return [r for k, r in self.seen.items() if k not in have]


async def read_back(endpoints: str | Sequence[str], prefix: str = "/leasehold/", *,
                    timeout_s: float = 5.0, leader_wait_s: float = 5.0,
                    kept: RecordKeeper | None = None) -> list[EtcdGrant | EtcdWindow | Leader]:
    """Every grant and window record under ``prefix``, and the current leader (waiting up to
    ``leader_wait_s`` for one to be elected).

    Grant records carry an etcd lease (they expire some time after their window), so read
    back promptly after the run; records read during it by ``kept`` and expired since are added
    (each record once: the final read's version where it still exists)."""
    store = EtcdStore(endpoints, timeout_s=timeout_s)
    out: list[EtcdGrant | EtcdWindow | Leader] = []
    try:
        records = await _read_records(store, prefix)
        out += records
        if kept is not None:
            out += kept.gone(records)
        leaders = await read_leaders(store, prefix)
        for _ in range(int(leader_wait_s / 0.25)):  # an election may be under way right after a fault
            if leaders:
                break
            await asyncio.sleep(0.25)
            leaders = await read_leaders(store, prefix)
        out += leaders
    finally:
        await store.close()
    return out
