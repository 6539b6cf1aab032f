"""The leader's memory of pool windows: each window's state as last read or committed, with the
window key's ``mod_revision``, so a grant is decided without reading etcd first.

Rules (what keeps it safe — etcd, not this cache, is the authority):

* **decided in place**: a transaction's strategy changes a cached state while it builds the
  transaction (a pool is in one transaction at a time, :mod:`allocator.grouping`); a transaction
  that does not commit :meth:`drop`\\ s its windows (their state in memory is ahead of etcd), one
  that commits caches them at its revision (:meth:`committed`);
* **tagged with the epoch it was read under**: an entry is used only by transactions fenced
  with the same epoch of its shard; after a leadership change (this replica lost a shard and won
  it again, or another leader wrote meanwhile) the window is read again. This is the one place
  leadership changes invalidate anything — nobody calls an ``invalidate``;
* **pruned** of windows that ended more than one window ago (at most once a second), counting
  the tokens of leases never reported;
* **one etcd lease per expiry bucket** for the records a window's transactions write
  (:class:`ExpiryLeases`): records expire without an etcd lease per key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import msgspec

from kernel.bundle import Pool
from kernel.etcd_store import KV, EtcdStore

from . import allocation
from .metrics import AllocatorMetrics
from .records import Keys

RECORD_MIN_LINGER_MS = 60_000  # a window's records stay at least this long after its end
WindowKey = tuple[str, int]  # (pool id, window index)


class CachedWindow:
    """A window's state as this leader last read or committed it."""

    __slots__ = ("state", "mod_revision", "key", "epoch", "etcd_lease", "lease_gen")

    def __init__(self, state: allocation.WindowState, mod_revision: int, key: bytes, epoch: int):
        self.state = state
        self.mod_revision = mod_revision  # 0 = not in etcd (yet, or any more)
        self.key = key
        self.epoch = epoch  # the shard's epoch it was read or committed under
        self.etcd_lease = 0  # the etcd lease its records are put with (ExpiryLeases generation lease_gen)
        self.lease_gen = -1


class ExpiryLeases:
    """Share one etcd lease per coarse expiry bucket, so keys expire without a lease per key.

    ``lease_for(expire_at_ms)`` returns a lease that lives until at least ``expire_at_ms``
    and at most one bucket (plus a margin) longer.
    """

    def __init__(self, store: EtcdStore, bucket_ms: int = 10_000, margin_s: int = 5):
        self.store = store
        self.bucket_ms = bucket_ms
        self.margin_s = margin_s
        self._leases: dict[int, int] = {}
        self.generation = 0  # bumped by forget(): a lease id kept elsewhere is stale when older

    def cached(self, expire_at_ms: int) -> int | None:
        """The bucket's lease if this process already holds it (no call), else None."""
        return self._leases.get(-(-expire_at_ms // self.bucket_ms))

    async def lease_for(self, expire_at_ms: int, now_ms: int) -> int:
        bucket = -(-expire_at_ms // self.bucket_ms)
        lid = self._leases.get(bucket)
        if lid is None:
            ttl_s = max(1, -(-(bucket * self.bucket_ms - now_ms) // 1000)) + self.margin_s
            lid = await self.store.lease_grant(ttl_s)
            self._leases[bucket] = lid
            for old in [b for b in self._leases if b * self.bucket_ms < now_ms]:
                del self._leases[old]
        return lid

    def forget(self) -> None:
        """etcd said one of them is gone: ask for new ones."""
        self._leases.clear()
        self.generation += 1


class WindowCache:
    def __init__(self, store: EtcdStore, keys: Keys, pools: Callable[[], Mapping[str, Pool]],
                 metrics: AllocatorMetrics):
        self.store = store
        self.keys = keys
        self._pools = pools  # the pools in force (they change with the bundle)
        self.metrics = metrics
        self._windows: dict[WindowKey, CachedWindow] = {}
        self._held: set[WindowKey] = set()  # windows a transaction in flight decides on (never pruned)
        self._last_prune_ms = 0
        self.expiry_leases = ExpiryLeases(store)

    def get(self, wk: WindowKey) -> CachedWindow:
        return self._windows[wk]

    def peek(self, wk: WindowKey, epoch: int) -> CachedWindow | None:
        """The cached window if it was read under ``epoch`` (for read-only use), else None."""
        c = self._windows.get(wk)
        return c if c is not None and c.epoch == epoch else None

    def hold(self, wks: Iterable[WindowKey]) -> None:
        self._held.update(wks)

    def release(self, wks: Iterable[WindowKey]) -> None:
        self._held.difference_update(wks)

    async def load(self, wanted: Mapping[WindowKey, int]) -> None:
        """Read every window of ``wanted`` (window -> the epoch its transaction fences with) that is
        not cached under that epoch, in one read."""
        missing = [wk for wk, epoch in wanted.items() if self.peek(wk, epoch) is None]
        if not missing:
            return
        keys = [self.keys.window(*wk) for wk in missing]
        found = await self.store.get_many(keys)
        for wk, key in zip(missing, keys, strict=True):
            self.put_read(wk, key, found.get(key), wanted[wk])

    def put_read(self, wk: WindowKey, key: bytes, kv: KV | None, epoch: int) -> None:
        """Cache a window as read from etcd (``kv`` None: not there, a new window)."""
        if kv is None:
            self._windows[wk] = CachedWindow(allocation.new_window(self._pools()[wk[0]], wk[1]), 0, key, epoch)
        else:
            self._windows[wk] = CachedWindow(msgspec.json.decode(kv.value, type=allocation.WindowState),
                                             kv.mod_revision, key, epoch)

    def drop(self, wks: Iterable[WindowKey]) -> None:
        """Forget windows a transaction decided on but did not commit (their state in memory is ahead)."""
        for wk in wks:
            self._windows.pop(wk, None)

    def committed(self, windows: Mapping[WindowKey, CachedWindow], revision: int) -> None:
        """A transaction's windows as committed at ``revision`` (cached again, if something dropped
        them meanwhile)."""
        for wk, c in windows.items():
            c.mod_revision = revision
            self._windows[wk] = c

    async def attach_leases(self, windows: Mapping[WindowKey, CachedWindow], now: int) -> None:
        """The etcd lease each window's records are put with (its expiry bucket's), kept on the
        cached window until the buckets are forgotten: rarely a call."""
        gen = self.expiry_leases.generation
        pools = self._pools()
        for wk, c in windows.items():
            if c.lease_gen != gen:
                expiry = record_expiry_ms(pools[wk[0]], wk[1])
                lid = self.expiry_leases.cached(expiry)
                c.etcd_lease = lid if lid is not None else await self.expiry_leases.lease_for(expiry, now)
                c.lease_gen = gen

    def prune(self, now: int) -> None:
        """Forget windows that ended more than one window ago; count their unreported tokens.
        A scan of every cached window, so at most once per second (it dominated grant latency
        with 10,000 pools when it ran after every transaction)."""
        if now - self._last_prune_ms < 1_000:
            return
        self._last_prune_ms = now
        pools = self._pools()
        for wk in [wk for wk in self._windows if wk[0] not in pools or (wk[1] + 2) * pools[wk[0]].window_ms < now]:
            if wk in self._held:
                continue  # a transaction in flight decides on it
            cached = self._windows.pop(wk)
            if cached.mod_revision:
                for region, tokens in allocation.unreported_tokens(cached.state).items():
                    self.metrics.unreported_tokens.labels(wk[0], self.metrics.region(region)).inc(tokens)


def record_expiry_ms(pool: Pool, index: int) -> int:
    """When the records of window ``index`` may go: its end plus max(W, 60 s)."""
    return (index + 1) * pool.window_ms + max(pool.window_ms, RECORD_MIN_LINGER_MS)
