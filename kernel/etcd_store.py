"""Thin etcd adapter over aetcd 1.0: endpoint failover, a timeout on every call, driver errors
translated to ``kernel.errors`` at this boundary, and shared expiry-bucket leases.

aetcd's ``Client`` talks to one endpoint; :class:`EtcdStore` holds the comma-separated list,
uses one at a time and moves to the next on connection failures or timeouts (each call tries
every endpoint at most once). A write retried on another endpoint after an ambiguous failure
is safe here because every write the allocator makes is a compare-and-swap transaction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.exceptions as aex
import aetcd.utils as aetcd_utils
import grpc
from aetcd.client import Transactions

from .errors import LeaseholdError, StoreUnavailable, Unavailable
from .etcd_tls import TlsClient

log = logging.getLogger("allocator.etcd")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops (compares, success and failure each)

# gRPC shares subchannels between channels to the same address, and with them the reconnect
# backoff (1 s growing 1.6x up to 120 s): a fresh client for an endpoint that failed a few times
# would fail fast with UNAVAILABLE for seconds after etcd is back. Each client gets its own
# subchannel, and reconnects are retried within a second.
CHANNEL_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}


class EtcdLeaseMissing(StoreUnavailable):
    """A put named an etcd lease that no longer exists (expired or revoked)."""

    code, title = "store-unavailable", "etcd lease missing"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        item = item.removeprefix("http://").removeprefix("https://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {raw!r} must be host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("at least one etcd endpoint is needed")
    return out


def _kv(get: Any) -> KV:
    return KV(key=bytes(get.key), value=bytes(get.value), create_revision=int(get.create_revision),
              mod_revision=int(get.mod_revision), version=int(get.version), lease=int(getattr(get, "lease", 0)))


class EtcdStore:
    """One logical etcd client over several endpoints."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 2.0,
                 observe: Callable[[str, float], None] | None = None,
                 user: str | None = None, password: str | None = None,
                 tls: grpc.ChannelCredentials | None = None):
        self.endpoints = parse_endpoints(endpoints)
        self._tls = tls  # kernel.etcd_tls.credentials(...) for https:// etcd endpoints
        self._auth = {"username": user, "password": password} if user else {}  # etcd authentication
        self.timeout_s = timeout_s
        self.t = Transactions()  # compare/op builders (stateless)
        self._observe = observe
        self._idx = 0
        self._client: aetcd.Client | None = None
        self._lock = asyncio.Lock()

    # -- connection management --------------------------------------------------------------
    async def _get_client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.endpoints[self._idx]
            self._client = TlsClient(host, port, timeout=max(1, int(self.timeout_s + 0.999)), tls=self._tls,
                                     options=dict(CHANNEL_OPTIONS), **self._auth)
        return self._client

    async def _rotate(self, failed: aetcd.Client) -> None:
        async with self._lock:
            if self._client is not failed:
                return  # someone already moved on
            self._client = None
            self._idx = (self._idx + 1) % len(self.endpoints)
        try:
            await asyncio.wait_for(failed.close(), 0.5)
        except Exception:  # noqa: BLE001 - closing a broken channel; nothing to report
            pass

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await asyncio.wait_for(client.close(), 1.0)
            except Exception:  # noqa: BLE001
                pass

    async def _call(self, op: str, fn: Callable[[aetcd.Client], Any]) -> Any:
        last = ""
        for _ in range(len(self.endpoints)):
            client = await self._get_client()
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(fn(client), self.timeout_s)
            except (TimeoutError, aex.ConnectionFailedError, aex.ConnectionTimeoutError,
                    aex.InternalError) as e:
                last = type(e).__name__
                log.warning("etcd %s failed on %s:%s (%s: %.200s); trying the next endpoint", op,
                            *self.endpoints[self._idx], last, str(e) or "-")
                await self._rotate(client)
                continue
            except aex.ClientError as e:
                if "lease not found" in str(e):
                    raise EtcdLeaseMissing(f"etcd {op}: lease not found") from None
                raise Unavailable(f"etcd {op} failed: {type(e).__name__}") from None
            except LeaseholdError:
                raise
            finally:
                if self._observe is not None:
                    self._observe(op, time.perf_counter() - started)
            return result
        raise StoreUnavailable(f"etcd unreachable ({op}: {last} on all {len(self.endpoints)} endpoints)")

    # -- operations ---------------------------------------------------------------------------
    async def get(self, key: bytes) -> KV | None:
        res = await self._call("get", lambda c: c.get(key))
        return None if res is None else _kv(res)

    async def get_prefix(self, prefix: bytes) -> list[KV]:
        async def run(c: aetcd.Client) -> list[KV]:
            return [_kv(g) for g in await c.get_prefix(prefix)]
        return await self._call("get_prefix", run)

    async def txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None,
                  ) -> tuple[bool, list[Any]]:
        for name, ops in (("compare", compare), ("success", success), ("failure", failure or [])):
            if len(ops) > MAX_TXN_OPS:
                raise ValueError(f"txn {name} has {len(ops)} ops (etcd allows {MAX_TXN_OPS})")
        return await self._call("txn", lambda c: c.transaction(compare=compare, success=success,
                                                               failure=failure or []))

    async def get_many(self, keys: list[bytes]) -> dict[bytes, KV]:
        """Read many keys in read-only transactions (one round trip per 128 keys)."""
        out: dict[bytes, KV] = {}
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i:i + MAX_TXN_OPS]
            _, responses = await self.txn([], [self.t.get(k) for k in chunk])
            for rng in responses:
                for _value, meta in rng:
                    kv = _kv(meta)
                    out[kv.key] = kv
        return out

    async def read_prefixes(self, prefixes: list[bytes], keys: Sequence[bytes] = ()) -> tuple[int, list[list[KV]]]:
        """Every key under each prefix, then each of ``keys``, in one read-only transaction (one
        consistent snapshot); (the snapshot's revision or 0 when no key was found, one KV list per
        prefix and per key)."""
        t = self.t
        ops = [t.get(p, range_end=prefix_range_end(p)) for p in prefixes] + [t.get(k) for k in keys]
        _, responses = await self.txn([], ops)
        revision = 0
        out: list[list[KV]] = []
        for rng in responses:
            out.append([_kv(meta) for _value, meta in rng])
            for _value, meta in rng:
                revision = max(revision, int(meta.header.revision))
        return revision, out

    async def lease(self, ttl_s: int) -> int:
        res = await self._call("lease_grant", lambda c: c.lease(ttl_s))
        return int(res.id)

    async def refresh(self, lease_id: int) -> int:
        """One keepalive; the remaining TTL in seconds (0 or less: the lease is gone)."""
        reply = await self._call("lease_keepalive", lambda c: c.refresh_lease(lease_id))
        return int(getattr(reply, "TTL", 0)) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        await self._call("lease_revoke", lambda c: c.revoke_lease(lease_id))


def prefix_range_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    return aetcd_utils.prefix_range_end(prefix)


def txn_revision(responses: list[Any]) -> int:
    """The revision a successful transaction committed at (from its first put's header)."""
    for r in responses:
        put = getattr(r, "response_put", None)
        if put is not None and put.header.revision:
            return int(put.header.revision)
    return 0


def range_kvs(response: Any) -> list[KV]:
    """KVs of a ``get`` op's response inside a transaction's answer."""
    return [_kv(meta) for _value, meta in response]


class LeaseBuckets:
    """Share one etcd lease per coarse expiry bucket, so keys expire without a lease per key.

    ``lease_for(expire_at_ms)`` returns a lease that lives until at least ``expire_at_ms``
    and at most one bucket (plus a margin) longer.
    """

    def __init__(self, store: EtcdStore, bucket_ms: int = 10_000, margin_s: int = 5):
        self.store = store
        self.bucket_ms = bucket_ms
        self.margin_s = margin_s
        self._leases: dict[int, int] = {}

    async def lease_for(self, expire_at_ms: int, now_ms: int) -> int:
        bucket = -(-expire_at_ms // self.bucket_ms)
        lid = self._leases.get(bucket)
        if lid is None:
            ttl_s = max(1, -(-(bucket * self.bucket_ms - now_ms) // 1000)) + self.margin_s
            lid = await self.store.lease(ttl_s)
            self._leases[bucket] = lid
            for old in [b for b in self._leases if b * self.bucket_ms < now_ms]:
                del self._leases[old]
        return lid

    def forget(self) -> None:
        self._leases.clear()
