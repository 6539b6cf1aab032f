"""Thin etcd adapter over aetcd 1.0: endpoint failover, a timeout on every call, driver errors
translated to ``kernel.errors`` at this boundary, and shared expiry-bucket leases.

The allocator's hot path builds its transactions as the protobuf ``TxnRequest`` itself
(:class:`TxnBuilder`, over the etcdserverpb stubs aetcd ships) and sends each with one call of
the KV stub (:meth:`EtcdStore.commit`): aetcd's per-op wrapper objects (a compare object, an op
object and a conversion to protobuf for each) cost about three times as much CPU as the message.
Everything else (elections, leases, reads, watches) goes through aetcd as before.

aetcd's ``Client`` talks to one endpoint; :class:`EtcdStore` holds the comma-separated list,
uses one at a time and moves to the next on connection failures or timeouts (each call tries
every endpoint at most once). A write retried on another endpoint after an ambiguous failure
is safe here because every write the allocator makes is a compare-and-swap transaction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions as aex
import aetcd.utils as aetcd_utils
import grpc
from aetcd import rpc
from aetcd.client import Transactions

from .errors import LeaseholdError, StoreUnavailable, Unavailable
from .etcd_endpoints import endpoints_scheme, parse_endpoints
from .etcd_tls import TlsClient

log = logging.getLogger("allocator.etcd")
T = TypeVar("T")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops (compares, success and failure each)
TXN_OPS_PROBE = (1024, 512, 256)  # what discover_max_txn_ops tries, largest first (then MAX_TXN_OPS)

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


class EtcdTxnTooLarge(Unavailable):
    """etcd refused a transaction for its size (more ops than its ``--max-txn-ops``, or more bytes
    than its ``--max-request-bytes``); nothing of it was applied. The store has lowered its own
    :attr:`EtcdStore.max_txn_ops`: the caller splits and retries."""

    title = "etcd transaction too large"

    @property
    def bytes_limit(self) -> bool:
        """Refused for its bytes (``--max-request-bytes``), not its op count."""
        return not any(m in self.detail for m in _TOO_MANY_OPS)


_TOO_MANY_OPS = ("too many operations in txn request", "ops in one branch")
_TOO_LARGE = (*_TOO_MANY_OPS, "request is too large", "larger than max")
_COMPACTED = "required revision has been compacted"


@dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


def _kv(get: Any) -> KV:
    return KV(key=bytes(get.key), value=bytes(get.value), create_revision=int(get.create_revision),
              mod_revision=int(get.mod_revision), version=int(get.version), lease=int(getattr(get, "lease", 0)))


async def abandon_after(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` for at most ``timeout_s``, then give up on it: the call is cancelled but *not
    waited for*. ``asyncio.wait_for`` waits for the cancelled call to finish, and a gRPC call to an
    etcd member that lost and regained the cluster can hang in its cancellation, which froze the
    allocator's election loop (no leader for 45 s after an etcd member was isolated and healed).
    Raises ``TimeoutError`` like ``wait_for``."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise TimeoutError
    if task.cancelled():
        # cancelled under us, not by our caller: grpc.aio cancels the calls in flight on a channel
        # that is closed, and a concurrent call that failed over to the next endpoint closes the
        # shared one. Letting that CancelledError through ended the allocator's election loop
        # silently (a cancelled task, no log): no leader until restart.
        raise CallInterrupted("etcd call cancelled by its channel closing")
    return task.result()


class CallInterrupted(TimeoutError):
    """An etcd call ended by its channel closing under it (retried on the next endpoint, like a
    timeout)."""


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned call's late error is not "never retrieved"


class RevisionCompacted(Unavailable):
    """The revision asked for is at or below etcd's compacted revision (a compaction to it is
    then already done)."""

    title = "etcd revision compacted"


class EtcdStore:
    """One logical etcd client over several endpoints.

    ``max_txn_ops``: the most ops a transaction may carry in each branch (etcd's
    ``--max-txn-ops``; 128 unless the cluster was started with more). ``None`` takes etcd's
    default until :meth:`discover_max_txn_ops` has asked the cluster; a transaction etcd refuses
    for its size lowers it (:class:`EtcdTxnTooLarge`)."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 2.0,
                 observe: Callable[[str, float], None] | None = None,
                 user: str | None = None, password: str | None = None,
                 tls: grpc.ChannelCredentials | None = None, max_txn_ops: int | None = None):
        self.endpoints = parse_endpoints(endpoints)
        scheme = endpoints_scheme(endpoints)
        if tls is not None and scheme == "http":
            raise ValueError("TLS credentials given for http:// etcd endpoints")
        if tls is None and scheme == "https":
            tls = grpc.ssl_channel_credentials()  # an https:// endpoint is never dialled in plaintext
        self.max_txn_ops = max(MAX_TXN_OPS, max_txn_ops or MAX_TXN_OPS)
        self.txn_ops_known = max_txn_ops is not None  # configured, or discovered from the cluster
        self._tls = tls  # kernel.etcd_tls.link_credentials(...): None = plaintext
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
            await abandon_after(failed.close(), 0.5)
        except Exception:  # noqa: BLE001 - closing a broken channel; nothing to report
            pass

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await abandon_after(client.close(), 1.0)
            except Exception:  # noqa: BLE001
                pass

    async def _call(self, op: str, fn: Callable[[aetcd.Client], Any]) -> Any:
        last = ""
        for _ in range(len(self.endpoints)):
            client = await self._get_client()
            started = time.perf_counter()
            try:
                result = await abandon_after(fn(client), self.timeout_s)
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
                if any(m in str(e) for m in _TOO_LARGE):
                    raise EtcdTxnTooLarge(f"etcd {op} refused: {str(e)[:160]}") from None
                if _COMPACTED in str(e):
                    raise RevisionCompacted(f"etcd {op}: {_COMPACTED}") from None
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

    async def commit(self, txn: TxnBuilder) -> TxnResult:
        """Send one transaction built with :class:`TxnBuilder`: one call of the KV stub, no
        wrapper objects. A transaction refused for its size raises :class:`EtcdTxnTooLarge` after
        lowering :attr:`max_txn_ops` (halved, not below etcd's default 128); one above the known
        limit raises it without being sent."""
        request = txn.request
        biggest = max(len(request.compare), len(request.success), len(request.failure))
        if biggest > self.max_txn_ops:  # e.g. built before a refusal lowered the limit: not sent
            raise EtcdTxnTooLarge(f"txn has {biggest} ops in one branch (this etcd allows {self.max_txn_ops})")
        try:
            resp = await self._send_txn(request)
        except EtcdTxnTooLarge as e:
            if e.bytes_limit:
                raise  # the caller sends fewer bytes
            lowered = max(MAX_TXN_OPS, min(self.max_txn_ops, biggest) // 2)
            if lowered < self.max_txn_ops:
                log.error("etcd refused a transaction of %d ops per branch (%d bytes): its --max-txn-ops or "
                          "--max-request-bytes is lower than this allocator assumed; using %d ops from now on",
                          biggest, request.ByteSize(), lowered)
            self.max_txn_ops = lowered
            raise
        return TxnResult(bool(resp.succeeded), int(resp.header.revision), resp.responses)

    async def _send_txn(self, request: Any) -> Any:
        async def send(c: aetcd.Client) -> Any:
            await c.connect()
            try:
                return await c.kvstub.Txn(request, timeout=c._timeout, metadata=c.metadata)
            except rpc.AioRpcError as e:
                aex._handle_exception(e)  # aetcd's own translation (then ours, in _call)
        return await self._call("txn", send)

    async def discover_max_txn_ops(self, probe_key: bytes, cap: int = TXN_OPS_PROBE[0]) -> int:
        """Ask the cluster how many ops a transaction may carry: read-only transactions of
        ``n`` gets of ``probe_key`` for n in ``TXN_OPS_PROBE`` (up to ``cap``), largest first;
        etcd refuses one above its ``--max-txn-ops`` before reading anything. Sets and returns
        :attr:`max_txn_ops` (etcd's default 128 when every probe is refused)."""
        for n in [n for n in TXN_OPS_PROBE if n <= cap]:
            txn = TxnBuilder()
            for _ in range(n):
                txn.get(probe_key)
            try:
                await self._send_txn(txn.request)
            except EtcdTxnTooLarge:
                continue
            self.max_txn_ops, self.txn_ops_known = n, True
            return n
        self.max_txn_ops, self.txn_ops_known = MAX_TXN_OPS, True
        return MAX_TXN_OPS

    async def get_many(self, keys: list[bytes]) -> dict[bytes, KV]:
        """Read many keys in read-only transactions (one round trip per ``max_txn_ops`` keys)."""
        out: dict[bytes, KV] = {}
        i, cap = 0, self.max_txn_ops
        while i < len(keys):
            step = min(cap, self.max_txn_ops)
            txn = TxnBuilder()
            for k in keys[i:i + step]:
                txn.get(k)
            try:
                res = await self.commit(txn)
            except EtcdTxnTooLarge as e:
                if e.bytes_limit and step > 1:
                    cap = step // 2  # the answer was too big for gRPC (4 MiB): fewer keys per read
                    continue
                if step <= MAX_TXN_OPS or e.bytes_limit:
                    raise
                continue  # commit() lowered max_txn_ops: again in smaller parts
            for kv in res.kvs():
                out[kv.key] = kv
            i += step
        return out

    async def compact(self, revision: int) -> bool:
        """Compact etcd's history (every key, not only ours) below ``revision``: the latest version
        of every key is kept, older versions at or below it are dropped. False when etcd had
        already compacted at or past it."""
        try:
            await self._call("compact", lambda c: c.compact(revision))
        except RevisionCompacted:
            return False
        return True

    async def revision(self, key: bytes) -> int:
        """etcd's current revision (the header of a read of ``key``, which may be absent)."""
        txn = TxnBuilder()
        txn.get(key)
        return (await self.commit(txn)).revision

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


_EQUAL = rpc.Compare.EQUAL
_CREATE, _MOD = rpc.Compare.CREATE, rpc.Compare.MOD


class TxnBuilder:
    """One etcd transaction built as the protobuf ``TxnRequest`` itself: each compare and op is
    one ``add`` on a repeated field (about a quarter of the CPU of aetcd's compare/op objects and
    their conversion). Send it with :meth:`EtcdStore.commit`."""

    __slots__ = ("request", "_compare", "_success", "_failure")

    def __init__(self) -> None:
        self.request = rpc.TxnRequest()
        self._compare = self.request.compare.add
        self._success = self.request.success.add
        self._failure = self.request.failure.add

    # -- compares -------------------------------------------------------------------------------
    def created_at(self, key: bytes, revision: int) -> None:
        """``create_revision(key) == revision`` (the fencing compare: a leader key's epoch)."""
        self._compare(result=_EQUAL, target=_CREATE, key=key, create_revision=revision)

    def modified_at(self, key: bytes, revision: int) -> None:
        """``mod_revision(key) == revision`` (the key is as last read or written)."""
        c = self._compare()
        c.target, c.key, c.mod_revision = _MOD, key, revision

    def absent(self, key: bytes) -> None:
        """``version(key) == 0`` (the key does not exist)."""
        self._compare().key = key  # (result EQUAL, target VERSION and version 0 are the defaults)

    def absent_many(self, keys: Iterable[bytes]) -> None:
        add = self._compare
        for key in keys:
            add().key = key

    # -- ops (success branch; ``failure=True`` for the other) --------------------------------------
    def put(self, key: bytes, value: bytes, lease: int = 0, *, failure: bool = False) -> None:
        put = (self._failure if failure else self._success)().request_put
        put.key, put.value, put.lease = key, value, lease

    def put_many(self, puts: Iterable[tuple[bytes, bytes, int]]) -> None:
        """``put(key, value, lease)`` for each triple (success branch)."""
        add = self._success
        for key, value, lease in puts:
            put = add().request_put
            put.key, put.value, put.lease = key, value, lease

    def get(self, key: bytes, *, failure: bool = False) -> None:
        (self._failure if failure else self._success)(request_range={"key": key})

    @property
    def ops(self) -> int:
        """The largest branch (compares, success ops, failure ops): what etcd's limit applies to."""
        r = self.request
        return max(len(r.compare), len(r.success), len(r.failure))


class TxnResult:
    """A committed (or refused) transaction: ``succeeded``, the ``revision`` of its header (for a
    successful write, the revision it committed at) and the raw ``ResponseOp`` list."""

    __slots__ = ("succeeded", "revision", "responses")

    def __init__(self, succeeded: bool, revision: int, responses: Any):
        self.succeeded = succeeded
        self.revision = revision
        self.responses = responses

    def kvs(self) -> list[KV]:
        """Every KV the transaction's range ops read, in op order."""
        return [_kv(kv) for r in self.responses if r.HasField("response_range") for kv in r.response_range.kvs]


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
        self.generation = 0  # bumped by forget(): a lease id kept elsewhere is stale when older

    def cached(self, expire_at_ms: int, now_ms: int) -> int | None:
        """The bucket's lease if this process already holds it (no call), else None."""
        return self._leases.get(-(-expire_at_ms // self.bucket_ms))

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
        self.generation += 1
