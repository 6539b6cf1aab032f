"""The etcd adapter: the one module that talks to etcd (everything else in Leasehold calls this).

It speaks etcd's gRPC API through the ``etcdserverpb`` stubs and messages that aetcd 1.0 ships
as generated code (``aetcd.rpc``: ``KVStub``, ``LeaseStub``, ``WatchStub``, ``MaintenanceStub``,
``AuthStub`` and their request types) over gRPC channels it opens itself — plaintext, or TLS with
the link's credentials (:mod:`kernel.etcd_tls`). No part of aetcd's ``Client`` is used, so
nothing here reads a private attribute of a library or replaces one; what this module relies on
(the generated names and fields) is checked by ``tests/unit/kernel/test_etcd_store_rpc.py``.
Why this shape, and why one channel per endpoint rather than one over all of them:
``docs/decisions/0023-etcd-adapter-on-the-generated-stubs.md``.

What it adds to the raw API:

* **endpoints**: the comma-separated list is used one endpoint at a time; a call that fails
  with a connection error or a timeout moves on to the next (each call tries every endpoint at
  most once), logged at most once per endpoint every ``ENDPOINT_LOG_EVERY_S``. A write retried
  on another endpoint after an ambiguous failure is safe here because every write Leasehold
  makes is a compare-and-swap transaction.
* **a bound on every call** (``timeout_s``), given up on without waiting for the cancelled call
  (:func:`abandon_after`).
* **authentication**: with a user, the token from etcd's ``Authenticate`` on every call; an
  expired token is renewed once and the call repeated.
* **errors** translated to ``kernel.errors`` at this boundary: :class:`EtcdLeaseMissing`,
  :class:`EtcdTxnTooLarge`, :class:`RevisionCompacted`, :class:`EtcdRefused` (etcd answers but
  refuses the client as it is set up: credentials, a permission of its role, the NOSPACE alarm,
  TLS), ``StoreUnavailable`` (no endpoint answered), ``Unavailable`` (anything else etcd refused).
* **refusals in force** (:attr:`EtcdStore.refused`): per kind of call (read, write, etcd lease,
  keepalive, or a caller's scope) the :class:`EtcdRefused` of its last refused call, logged once
  when it starts and once when a call of its kind is accepted again — a refusal lasts until an
  operator acts, so it is a state, not a line per call.
* **transactions** as the protobuf ``TxnRequest`` itself (:class:`TxnBuilder`, one ``add`` per
  compare or op; sent with one call, :meth:`EtcdStore.commit`): the allocator's hot path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from aetcd import rpc  # the generated etcdserverpb code (messages and stubs), nothing of aetcd's client

from .errors import LeaseholdError, StoreUnavailable, Unavailable
from .etcd_endpoints import endpoints_scheme, parse_endpoints
from .ratelog import KeyedLog

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops (compares, success and failure each)
TXN_OPS_PROBE = (1024, 512, 256)  # what discover_max_txn_ops tries, largest first (then MAX_TXN_OPS)

# gRPC shares subchannels between channels to the same address, and with them the reconnect
# backoff (1 s growing 1.6x up to 120 s): a fresh channel to an endpoint that failed a few times
# would fail fast with UNAVAILABLE for seconds after etcd is back. Each channel gets its own
# subchannel, and reconnects are retried within a second.
CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

# status codes after which the call is tried on the next endpoint: the member is down, cut off
# from its cluster ("etcdserver: request timed out", "no leader" are UNAVAILABLE) or its channel
# was closed under the call
_NEXT_ENDPOINT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED})
_TOO_MANY_OPS = ("too many operations in txn request", "ops in one branch")
_TOO_LARGE = (*_TOO_MANY_OPS, "request is too large", "larger than max")
_COMPACTED = "required revision has been compacted"
# at most one "trying the next endpoint" line per endpoint this often (the next says how many were
# not written): an outage fails every call of every election round, four a second
ENDPOINT_LOG_EVERY_S = 10.0
_LEASE_MISSING = "lease not found"
_TOKEN_EXPIRED = "invalid auth token"
_AUTH_NOT_ENABLED = "authentication is not enabled"
_REAUTHENTICATE = (_TOKEN_EXPIRED, "user name not found", "revision of auth store is old")
# what etcd (3.4/3.5) answers when it refuses the client as it is set up (EtcdRefused causes)
_REFUSALS = (
    (grpc.StatusCode.INVALID_ARGUMENT, ("authentication failed", "user name not found", "invalid auth token",
                                        "user name is empty"), "auth"),
    (grpc.StatusCode.FAILED_PRECONDITION, ("authentication failed", "invalid auth token"), "auth"),
    (grpc.StatusCode.UNAUTHENTICATED, ("",), "auth"),
    (grpc.StatusCode.PERMISSION_DENIED, ("",), "permission"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ("database space exceeded",), "nospace"),
)
# grpc's words for a TLS handshake that failed: etcd's certificate did not verify (CA, expiry;
# a host name it does not name is grpc's separate "Hostname Verification Check"), or etcd refused ours (no certificate, another CA's, expired: the connection is torn
# down mid-handshake, which grpc reports as an unwrap failure)
_TLS_FAILURE = ("handshake failed", "Unwrap failed", "TSI_", "CERTIFICATE_VERIFY_FAILED",
                "Hostname Verification Check failed", "verification check failed")


class EtcdLeaseMissing(StoreUnavailable):
    """A put or keepalive named an etcd lease that no longer exists (expired or revoked)."""

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


class RevisionCompacted(Unavailable):
    """The revision asked for is at or below etcd's compacted revision (a compaction to it is
    then already done)."""

    title = "etcd revision compacted"


class EtcdRefused(Unavailable):
    """etcd answers but refuses this client as it is set up, not this call: ``cause`` ``auth``
    (the user or password is wrong, or the user was deleted), ``permission`` (the user's role lacks
    a permission the call needs), ``nospace`` (the NOSPACE alarm: the database reached
    ``--quota-backend-bytes`` and etcd refuses every write until an operator compacts, defrags and
    disarms it) or ``tls`` (the TLS handshake failed on every endpoint: etcd's certificate did not
    verify against the CA given, or etcd refused the client certificate). Nothing was applied.
    It lasts until an operator acts: retriable for the caller (a 503), a deployment error at a
    start (the allocator refuses to start on ``auth``, ``permission`` and ``tls``)."""

    code, title = "store-refused", "etcd refused the call"

    CAUSES = {"auth": "the etcd user or password was refused (authentication failed)",
              "permission": "permission denied: the etcd user's role lacks a permission this call needs",
              "nospace": "NOSPACE: the etcd database is over its --quota-backend-bytes (alarm raised); "
                         "etcd refuses every write",
              "tls": "the TLS handshake with etcd failed (its certificate did not verify against the CA given, "
                     "or it refused the client certificate)"}

    def __init__(self, op: str, cause: str):
        super().__init__(f"etcd {op} refused: {self.CAUSES[cause]}", extra={"cause": cause})
        self.op = op
        self.cause = cause


class EtcdHandshakeRefused(EtcdRefused, StoreUnavailable):
    """:class:`EtcdRefused` for its ``tls`` cause: no connection was made, so it is also what a
    caller treats as etcd not reached (the CLI's connect failure, exit 5)."""

    code, title = EtcdRefused.code, EtcdRefused.title


class CallInterrupted(TimeoutError):
    """An etcd call ended by its channel closing under it (retried on the next endpoint, like a
    timeout)."""


@dataclass(frozen=True, slots=True)
class KV:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0  # the etcd lease the key is attached to (0: none)


def _kv(m: Any) -> KV:
    return KV(key=bytes(m.key), value=bytes(m.value), create_revision=int(m.create_revision),
              mod_revision=int(m.mod_revision), version=int(m.version), lease=int(m.lease))


def prefix_range_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix`` (etcd's rule:
    the prefix with its last byte below 0xff incremented; ``\\0`` = every key above)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


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


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned call's late error is not "never retrieved"


class _Link:
    """One endpoint: its channel, the stubs over it and the authentication token."""

    def __init__(self, host: str, port: int, tls: grpc.ChannelCredentials | None):
        target = f"{host}:{port}"
        self.name = target
        self.channel = (grpc.aio.secure_channel(target, tls, options=CHANNEL_OPTIONS) if tls is not None
                        else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS))
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.maintenance = rpc.MaintenanceStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] | None = None  # (("token", ...),) once authenticated


class Watch:
    """An open etcd watch: ``async for response in watch`` yields each ``WatchResponse`` that
    carries events; it ends with an error when etcd cancels the watch (a compaction) or the
    stream breaks. :meth:`cancel` closes it."""

    def __init__(self, call: Any):
        self._call = call

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        while True:
            try:
                resp = await self._call.read()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # we are being stopped
                raise StoreUnavailable("etcd watch ended by its channel closing") from None
            except grpc.aio.AioRpcError as e:
                raise StoreUnavailable(f"etcd watch failed: {e.code().name}") from None
            if resp is grpc.aio.EOF:
                raise StoreUnavailable("etcd watch stream ended")
            if resp.canceled:
                raise StoreUnavailable(f"etcd cancelled the watch: {resp.cancel_reason or 'no reason given'}")
            if resp.events:
                yield resp

    async def cancel(self) -> None:
        self._call.cancel()


class EtcdStore:
    """One logical etcd client over several endpoints (the module docstring says what it adds).

    ``max_txn_ops``: the most ops a transaction may carry in each branch (etcd's
    ``--max-txn-ops``; 128 unless the cluster was started with more). ``None`` takes etcd's
    default until :meth:`discover_max_txn_ops` has asked the cluster; a transaction etcd refuses
    for its size lowers it (:class:`EtcdTxnTooLarge`)."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 2.0,
                 observe: Callable[[str, float], None] | None = None,
                 user: str | None = None, password: str | None = None,
                 tls: grpc.ChannelCredentials | None = None, max_txn_ops: int | None = None,
                 report_refusals: bool = True):
        self.endpoints = parse_endpoints(endpoints)
        scheme = endpoints_scheme(endpoints)
        if tls is not None and scheme == "http":
            raise ValueError("TLS credentials given for http:// etcd endpoints")
        if tls is None and scheme == "https":
            tls = grpc.ssl_channel_credentials()  # an https:// endpoint is never dialled in plaintext
        self.max_txn_ops = max(MAX_TXN_OPS, max_txn_ops or MAX_TXN_OPS)
        self.txn_ops_known = max_txn_ops is not None  # configured, or discovered from the cluster
        self.timeout_s = timeout_s
        self._tls = tls  # kernel.etcd_tls.link_credentials(...): None = plaintext
        self._user = (user, password or "") if user else None  # etcd authentication
        self._observe = observe
        self._idx = 0
        self._link: _Link | None = None
        self._lock = asyncio.Lock()
        # the refusal in force per kind of call ("read", "write", "lease" (grant, revoke),
        # "keepalive", or a scope a caller names in commit): set by a refused call, cleared by an
        # accepted one of the same kind. Kinds, because etcd refuses them apart: a NOSPACE alarm
        # refuses writes and lease grants while reads and keepalives pass, keepalives need no
        # permission, and a role may lose one key space's permission and keep the others'
        # (docs/decisions/0065-etcd-refusals-are-a-state-and-stop-the-start.md)
        self.refused: dict[str, EtcdRefused] = {}
        # False: a caller that reports what it met itself (a start check, whose refusal is one line:
        # neither the refusals nor the endpoints it tried are logged)
        self._report_refusals = report_refusals
        self._endpoint_log = KeyedLog(log, interval_s=ENDPOINT_LOG_EVERY_S, max_keys=64)

    # -- endpoints ----------------------------------------------------------------------------
    def _current(self) -> _Link:
        if self._link is None:
            host, port = self.endpoints[self._idx]
            self._link = _Link(host, port, self._tls)
        return self._link

    async def _next_endpoint(self, failed: _Link) -> None:
        async with self._lock:
            if self._link is not failed:
                return  # someone already moved on
            self._link = None
            self._idx = (self._idx + 1) % len(self.endpoints)
        try:
            await abandon_after(failed.channel.close(), 0.5)
        except Exception:  # noqa: BLE001 - closing a broken channel; nothing to report
            pass

    async def close(self) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            try:
                await abandon_after(link.channel.close(), 1.0)
            except Exception:  # noqa: BLE001
                pass

    async def _authenticate(self, link: _Link) -> None:
        assert self._user is not None
        name, password = self._user
        try:
            resp = await link.auth.Authenticate(rpc.AuthenticateRequest(name=name, password=password),
                                                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if _AUTH_NOT_ENABLED not in (e.details() or ""):
                raise
            # etcd runs without authentication (as etcd's own client does: the calls go without a
            # token); it is turned on later by the roles script, then the token is fetched
            link.metadata = ()
            return
        link.metadata = (("token", resp.token),)

    async def _call(self, op: str, fn: Callable[[_Link], Awaitable[T]], kind: str = "read",
                    bound_s: float | None = None) -> T:
        """``fn(link)`` on the current endpoint, bounded, moving on to the next endpoint on a
        connection failure or timeout; etcd's refusals translated to ``kernel.errors``. ``kind``
        (``read``, ``write`` or a caller's scope): which refusal in force (:attr:`refused`) the
        outcome sets or clears. ``bound_s``: each endpoint's attempt is given up after this long
        (default :attr:`timeout_s`; a caller with a deadline of its own, a session's keepalive,
        gives less, so that the next endpoint is tried in time)."""
        last = ""
        tls_failures = 0
        for _ in range(len(self.endpoints)):
            link = self._current()
            started = time.perf_counter()
            try:
                result = await abandon_after(self._authenticated(link, fn), bound_s or self.timeout_s)
            except TimeoutError as e:
                last = type(e).__name__
            except grpc.aio.AioRpcError as e:
                code, detail = e.code(), e.details() or ""
                if code not in _NEXT_ENDPOINT:
                    raise self._refusal(op, kind, code, detail) from None
                last = f"{code.name}: {detail[:200]}"
                tls_failures += any(m in detail for m in _TLS_FAILURE)
            else:
                if kind in self.refused:
                    self._accepted(kind)
                return result
            finally:
                if self._observe is not None:
                    self._observe(op, time.perf_counter() - started)
            if self._report_refusals:
                self._endpoint_log.log(link.name, logging.WARNING,
                                       f"etcd {op} failed on {link.name} ({last}); trying the next endpoint")
            await self._next_endpoint(link)
        if tls_failures == len(self.endpoints):  # every endpoint answered, and refused the handshake
            raise self._refused(kind, EtcdHandshakeRefused(op, "tls"))
        raise StoreUnavailable(f"etcd unreachable ({op}: {last.split(':')[0]} on all {len(self.endpoints)} endpoints)")

    def _refusal(self, op: str, kind: str, code: grpc.StatusCode, detail: str) -> LeaseholdError:
        err = _refusal(op, code, detail)
        return self._refused(kind, err) if isinstance(err, EtcdRefused) else err

    def _refused(self, kind: str, err: EtcdRefused) -> EtcdRefused:
        """Note a refusal of a ``kind`` of call; logged when it starts (or its cause changes)."""
        before = self.refused.get(kind)
        if self._report_refusals and (before is None or before.cause != err.cause):
            log.error("etcd refuses this client's %s calls (%s: first refused: %s); %s", kind, err.cause, err.op,
                      EtcdRefused.CAUSES[err.cause])
        self.refused[kind] = err
        return err

    def _accepted(self, kind: str) -> None:
        gone = self.refused.pop(kind, None)
        if gone is not None and self._report_refusals:
            log.warning("etcd accepts this client's %s calls again (refused until now: %s)", kind, gone.cause)

    async def _authenticated(self, link: _Link, fn: Callable[[_Link], Awaitable[T]]) -> T:
        if self._user is None:
            return await fn(link)
        if link.metadata is None:
            await self._authenticate(link)
        try:
            return await fn(link)
        except grpc.aio.AioRpcError as e:
            detail = e.details() or ""
            # a new token is asked for once when the one held expired (or etcd restarted: simple
            # tokens live in its memory), the user was re-created, etcd's auth store changed under
            # it, or authentication was turned on after this link found it off
            expired = any(m in detail for m in _REAUTHENTICATE) or (not link.metadata and "user name is empty" in detail)
            if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) or not expired:
                raise
        await self._authenticate(link)  # the token expired: a new one, and the call once more
        return await fn(link)

    # -- reads ----------------------------------------------------------------------------------
    async def get(self, key: bytes) -> KV | None:
        async def run(link: _Link) -> Any:
            return await link.kv.Range(rpc.RangeRequest(key=key), timeout=self.timeout_s, metadata=link.metadata)
        resp = await self._call("get", run)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: bytes) -> list[KV]:
        async def run(link: _Link) -> Any:
            return await link.kv.Range(rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix)),
                                       timeout=self.timeout_s, metadata=link.metadata)
        return [_kv(m) for m in (await self._call("get_prefix", run)).kvs]

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

    async def snapshot(self, prefixes: Sequence[bytes], keys: Sequence[bytes] = (),
                       bound_s: float | None = None) -> tuple[int, list[list[KV]]]:
        """Every key under each prefix, then each of ``keys``, in one read-only transaction (one
        consistent snapshot): (its revision, one KV list per prefix and per key). ``bound_s`` as
        for :meth:`lease_keepalive`."""
        txn = TxnBuilder()
        for p in prefixes:
            txn.get_range(p, prefix_range_end(p))
        for k in keys:
            txn.get(k)
        async def run(link: _Link) -> Any:
            return await link.kv.Txn(txn.request, timeout=self.timeout_s, metadata=link.metadata)
        resp = await self._call("txn", run, "read", bound_s)
        res = TxnResult(bool(resp.succeeded), int(resp.header.revision), resp.responses)
        return res.revision, res.ranges()

    async def revision(self, key: bytes) -> int:
        """etcd's current revision (the header of a read of ``key``, which may be absent)."""
        txn = TxnBuilder()
        txn.get(key)
        return (await self.commit(txn)).revision

    # -- transactions -------------------------------------------------------------------------
    async def commit(self, txn: TxnBuilder, scope: str | None = None) -> TxnResult:
        """Send one transaction built with :class:`TxnBuilder`: one call of the KV stub. A
        transaction refused for its size raises :class:`EtcdTxnTooLarge` after lowering
        :attr:`max_txn_ops` (halved, not below etcd's default 128); one above the known limit
        raises it without being sent. ``scope``: under which name a refusal of it is kept in
        :attr:`refused` (default ``write`` or ``read``), cleared by the next accepted call of that
        scope — a role may lack the permission of one key space and keep the others'."""
        request = txn.request
        biggest = max(len(request.compare), len(request.success), len(request.failure))
        if biggest > self.max_txn_ops:  # e.g. built before a refusal lowered the limit: not sent
            raise EtcdTxnTooLarge(f"txn has {biggest} ops in one branch (this etcd allows {self.max_txn_ops})")
        try:
            resp = await self._send_txn(request, scope)
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

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """One unconditional write (attached to the etcd lease ``lease``, 0 for none); the
        revision it committed at."""
        txn = TxnBuilder()
        txn.put(key, value, lease)
        return (await self.commit(txn)).revision

    async def _send_txn(self, request: Any, scope: str | None = None) -> Any:
        async def run(link: _Link) -> Any:
            return await link.kv.Txn(request, timeout=self.timeout_s, metadata=link.metadata)
        return await self._call("txn", run, scope or ("write" if _writes(request) else "read"))

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

    # -- maintenance ----------------------------------------------------------------------------
    async def compact(self, revision: int) -> bool:
        """Compact etcd's history (every key, not only ours) below ``revision``: the latest version
        of every key is kept, older versions at or below it are dropped. False when etcd had
        already compacted at or past it."""
        async def run(link: _Link) -> Any:
            return await link.kv.Compact(rpc.CompactionRequest(revision=revision), timeout=self.timeout_s,
                                         metadata=link.metadata)
        try:
            await self._call("compact", run, "write")
        except RevisionCompacted:
            return False
        return True

    # -- etcd leases --------------------------------------------------------------------------
    async def lease_grant(self, ttl_s: int) -> int:
        """A new etcd lease of ``ttl_s`` seconds; its id."""
        async def run(link: _Link) -> Any:
            return await link.lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout_s,
                                               metadata=link.metadata)
        return int((await self._call("lease_grant", run, "lease")).ID)

    async def lease_keepalive(self, lease_id: int, bound_s: float | None = None) -> int:
        """One keepalive; the remaining TTL in seconds (0 or less: the lease is gone). ``bound_s``:
        the most one endpoint is waited for before the next is tried (default :attr:`timeout_s`)."""
        async def run(link: _Link) -> Any:
            call = link.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
                                             timeout=self.timeout_s, metadata=link.metadata)
            try:
                return await call.read()
            finally:
                call.cancel()
        reply = await self._call("lease_keepalive", run, "keepalive", bound_s)
        return 0 if reply is grpc.aio.EOF else int(reply.TTL)

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke an etcd lease: every key attached to it is deleted at once."""
        async def run(link: _Link) -> Any:
            return await link.lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=self.timeout_s,
                                                metadata=link.metadata)
        await self._call("lease_revoke", run, "lease")

    # -- watches --------------------------------------------------------------------------------
    async def watch(self, key: bytes, range_end: bytes = b"") -> Watch:
        """Watch ``key`` (or ``[key, range_end)``) from now on; returns once etcd created the
        watch (everything written after that is seen)."""
        async def run(link: _Link) -> Watch:
            call = link.watch.Watch(metadata=link.metadata)
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=key, range_end=range_end)))
            first = await call.read()
            if first is grpc.aio.EOF or not first.created or first.canceled:
                call.cancel()
                raise StoreUnavailable("etcd did not create the watch")
            return Watch(call)
        return await self._call("watch", run)


def _writes(request: Any) -> bool:
    """Whether a transaction writes (a put or delete in either branch): etcd's NOSPACE alarm and a
    role's read-only permission refuse those and pass read-only ones."""
    return any(not op.HasField("request_range") for branch in (request.success, request.failure) for op in branch)


def _refusal(op: str, code: grpc.StatusCode, detail: str) -> LeaseholdError:
    """What an etcd refusal (a status the next endpoint would give too) means to the caller."""
    if _LEASE_MISSING in detail:
        return EtcdLeaseMissing(f"etcd {op}: lease not found")
    if any(m in detail for m in _TOO_LARGE):
        return EtcdTxnTooLarge(f"etcd {op} refused: {detail[:160]}")
    if _COMPACTED in detail:
        return RevisionCompacted(f"etcd {op}: {_COMPACTED}")
    for status, words, cause in _REFUSALS:
        if code == status and any(w in detail for w in words):
            return EtcdRefused(op, cause)
    return Unavailable(f"etcd {op} failed: {code.name}: {detail[:120]}")


_EQUAL = rpc.Compare.EQUAL
_CREATE, _MOD, _VALUE = rpc.Compare.CREATE, rpc.Compare.MOD, rpc.Compare.VALUE


class TxnBuilder:
    """One etcd transaction built as the protobuf ``TxnRequest`` itself: each compare and op is
    one ``add`` on a repeated field (about a quarter of the CPU of wrapper objects and their
    conversion). Send it with :meth:`EtcdStore.commit`. Ops go to the success branch, or with
    ``failure=True`` to the other."""

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

    def as_read(self, keys: Iterable[tuple[bytes, int]]) -> None:
        """For each (key, mod_revision): :meth:`modified_at` the revision, or :meth:`absent` when it
        is 0 (the key was not there when read)."""
        add = self._compare
        for key, revision in keys:
            if revision:
                c = add()
                c.target, c.key, c.mod_revision = _MOD, key, revision
            else:
                add().key = key

    def absent_many(self, keys: Iterable[bytes]) -> None:
        add = self._compare
        for key in keys:
            add().key = key

    def holds(self, key: bytes, value: bytes) -> None:
        """``value(key) == value``."""
        self._compare(result=_EQUAL, target=_VALUE, key=key, value=value)

    # -- ops ------------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes, lease: int = 0, *, failure: bool = False) -> None:
        """Write ``key`` (attached to the etcd lease ``lease``, 0 for none)."""
        put = (self._failure if failure else self._success)().request_put
        put.key, put.value, put.lease = key, value, lease

    def put_many(self, puts: Iterable[tuple[bytes, bytes, int]]) -> None:
        """``put(key, value, lease)`` for each triple (success branch)."""
        add = self._success
        for key, value, lease in puts:
            put = add().request_put
            put.key, put.value, put.lease = key, value, lease

    def delete(self, key: bytes, *, failure: bool = False) -> None:
        (self._failure if failure else self._success)().request_delete_range.key = key

    def get(self, key: bytes, *, failure: bool = False) -> None:
        (self._failure if failure else self._success)().request_range.key = key

    def get_range(self, key: bytes, range_end: bytes, *, failure: bool = False) -> None:
        """Every key in ``[key, range_end)`` (``prefix_range_end(p)``: every key under ``p``)."""
        r = (self._failure if failure else self._success)().request_range
        r.key, r.range_end = key, range_end


class TxnResult:
    """A committed (or refused) transaction: ``succeeded``, the ``revision`` of its header (for a
    successful write, the revision it committed at: the ``create_revision`` of each key it
    created) and the raw ``ResponseOp`` list of the branch that ran."""

    __slots__ = ("succeeded", "revision", "responses")

    def __init__(self, succeeded: bool, revision: int, responses: Any):
        self.succeeded = succeeded
        self.revision = revision
        self.responses = responses

    def kvs(self) -> list[KV]:
        """Every KV the transaction's range ops read, in op order."""
        return [_kv(kv) for r in self.responses if r.HasField("response_range") for kv in r.response_range.kvs]

    def ranges(self) -> list[list[KV]]:
        """The KVs of each range op of the branch that ran, one list per op, in op order."""
        return [[_kv(kv) for kv in r.response_range.kvs] for r in self.responses if r.HasField("response_range")]
