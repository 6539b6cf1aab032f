"""Every private part of redis-py (and of asyncio's streams) the agent's store path touches, and
the three functions that touch them. Nothing else in the project reads a private name of redis-py.

Why they are touched at all (a standalone pipeline is most of the agent's CPU per decision; see
``make bench`` figure 1):

* :func:`write_now` hands a pipeline to the connection's transport (``conn._writer``) without
  redis-py's send, which on Python 3.11 starts a task per send (``asyncio.wait_for``);
* :func:`read_replies` takes the replies buffered behind a pipeline's first one straight from
  the connection's hiredis reader (``conn._parser._reader`` of redis-py's
  ``_AsyncHiredisParser``), without redis-py's per-reply timeout context;
* :func:`answer_waiting` tells a busy agent from a silent store by the bytes a connection has
  received and not yet parsed (``conn._reader._buffer``, the asyncio ``StreamReader``'s buffer);
* :class:`HeldConnections` keeps a node's pipeline connections checked out of redis-py's pool
  between pipelines (a checkout and a release cost a lock each way, a deprecation wrapper, four
  observability calls and a release event: about 11 us per pipeline), and :func:`sendable`
  checks a held connection as the pool's checkout would (``ensure_connection``: open, nothing
  unread, not at end of file; ``release``: not marked to reconnect) before it is used again —
  with the parser's and the stream's buffers (``_AsyncHiredisParser._reader``,
  ``StreamReader._buffer``) and the transport, as redis-py 8.1's ``can_read`` reads them;
* :class:`ConnectionPool` (and :class:`SentinelConnectionPool`), the agent's pools, reconnect at
  checkout a connection the server closed while it was idle (:func:`closed_by_server`: the
  stream's end of file, ``StreamReader._eof``, or a closing transport), which redis-py 8.1's
  checkout hands out as it is when maintenance notifications are on (its default).

These are checked when this module is imported (:func:`missing`): a redis-py, hiredis or Python
release that renames one stops the agent at start with :class:`RedisInternalsChanged` naming it,
instead of silently falling back to a slower path or misjudging the store. The upper bounds on
``redis`` and ``hiredis`` in pyproject.toml name the versions this was checked with;
tests/unit/region_agent/store/test_redis_internals.py fails when one disappears.
"""

from __future__ import annotations

import asyncio
import select
from typing import Any

import hiredis
import redis
from redis import exceptions as rex
from redis.asyncio import connection as _aconn
from redis.asyncio import sentinel as _sentinel
from redis.credentials import StreamingCredentialProvider


class RedisInternalsChanged(RuntimeError):
    """A private part of redis-py, hiredis or asyncio this module relies on is gone or renamed."""


try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
except ImportError as e:  # the unit test reaches this through a reload
    raise RedisInternalsChanged(
        f"redis-py {redis.__version__}: redis._parsers.hiredis has no _AsyncHiredisParser or NOT_ENOUGH_DATA "
        f"(region_agent/store/redis_internals.py)") from e


def missing(connection_cls: Any = _aconn.Connection, parser_cls: Any = _AsyncHiredisParser,
            default_parser: Any = None, hiredis_module: Any = hiredis,
            stream_reader_cls: Any = asyncio.StreamReader, pool_cls: Any = _aconn.ConnectionPool) -> list[str]:
    """The private parts this module uses that the installed libraries lack (empty: all there).
    The arguments are for the unit test; the defaults are the real classes."""
    gone: list[str] = []
    default_parser = _aconn.DefaultParser if default_parser is None else default_parser
    if default_parser is not parser_cls:
        gone.append("redis.asyncio.connection.DefaultParser is not _AsyncHiredisParser (hiredis not used)")
    conn = connection_cls()
    gone += [f"redis.asyncio.Connection().{name}" for name in ("_reader", "_writer", "_parser", "health_check_interval")
             if not hasattr(conn, name)]
    gone += [f"redis.asyncio.Connection.{name}" for name in ("is_connected", "should_reconnect")
             if not hasattr(connection_cls, name)]
    gone += [f"redis.asyncio.ConnectionPool.{name}" for name in ("connection_kwargs", "ensure_connection")
             if not hasattr(pool_cls, name)]
    if not hasattr(parser_cls(65_536), "_reader"):
        gone.append("_AsyncHiredisParser()._reader")
    gone += [f"hiredis.{name}" for name in ("Reader", "PushNotification") if not hasattr(hiredis_module, name)]
    reader_cls = getattr(hiredis_module, "Reader", None)
    gone += [f"hiredis.Reader.{name}" for name in ("gets", "has_data") if not hasattr(reader_cls, name)]
    loop = asyncio.new_event_loop()
    try:
        stream = stream_reader_cls(loop=loop)
        gone += [f"asyncio.StreamReader().{name}" for name in ("_buffer", "_eof") if not hasattr(stream, name)]
    finally:
        loop.close()
    return gone


_gone = missing()
if _gone:
    raise RedisInternalsChanged(f"redis-py {redis.__version__} / hiredis {hiredis.__version__}: "
                                f"missing {', '.join(_gone)} (region_agent/store/redis_internals.py)")

PUSH = hiredis.PushNotification
FAST_READS = True  # False: every reply through redis-py's read (the tests compare both paths)


def write_now(conn: Any, payload: bytes) -> bool:
    """Hand ``payload`` to an open connection's transport without awaiting, when nothing is
    waiting in its write buffer and no health check is configured; False: send it through
    redis-py (``send_packed_command``: connect, health check, drain under the socket timeout).

    An empty buffer means the kernel took everything sent so far, so there is nothing to wait
    for; what the kernel does not take now stays buffered and the transport sends it when the
    socket is writable (the next send on this connection then sees it and drains through
    redis-py). A write failure closes the transport, so the read that follows fails and the
    connection is disconnected."""
    writer = conn._writer
    if writer is None or conn._reader is None or conn.health_check_interval:
        return False
    transport = writer.transport
    if transport.is_closing() or transport.get_write_buffer_size():
        return False
    writer.write(payload)
    return True


def _hiredis_reader(conn: Any) -> Any:
    parser = conn._parser
    if not FAST_READS or parser.__class__ is not _AsyncHiredisParser:
        return None
    return parser._reader


async def read_replies(conn: Any, n: int) -> list[Any]:
    """The next ``n`` replies on ``conn``; an error reply as its exception instance (what
    ``raise_on_error=False`` gives). The first reply is awaited through redis-py (its socket
    timeout, its disconnect on failure); with the hiredis parser, the replies already buffered
    behind it are then taken from hiredis directly — redis-py's per-reply read (a timeout
    context, its checks) cost more than parsing. Anything unusual in the buffer (a connection
    error, a RESP3 push) and every reply not yet received go through redis-py's read."""
    replies: list[Any] = []
    reader = _hiredis_reader(conn)
    while len(replies) < n:
        if reader is not None and replies:
            r = reader.gets()
            if r.__class__ is list and r and r[0].__class__ is int:  # a script's usual reply: no checks needed
                replies.append(r)
                continue
            if r is not NOT_ENOUGH_DATA:
                # as redis-py's read: an error reply is its exception instance (ResponseError,
                # kept as the reply), a connection-level one is raised; a RESP3 push is unexpected
                if isinstance(r, BaseException) and not isinstance(r, rex.ResponseError):
                    raise r
                if r.__class__ is list and r and isinstance(r[0], BaseException):
                    raise r[0]
                if isinstance(r, PUSH):
                    raise rex.ConnectionError("unexpected push reply in a pipeline's answer")
                replies.append(r)
                continue
        try:
            replies.append(await conn.read_response())
        except rex.ResponseError as e:
            replies.append(e)
    return replies


def answer_waiting(conn: Any) -> bool:
    """Has the store sent bytes this connection has not consumed yet — buffered by the stream
    reader or the reply parser, or still in the kernel's receive buffer? True means the store
    answered and only this process has not read it (it is busy), not that the store is silent.
    ``conn``: a redis-py connection; anything else (a test's stand-in) has nothing waiting."""
    if not isinstance(conn, _aconn.AbstractConnection):
        return False
    stream = conn._reader
    if stream is not None and len(stream._buffer):
        return True
    parser = conn._parser
    if parser.__class__ is _AsyncHiredisParser and parser._reader is not None and parser._reader.has_data():
        return True
    writer = conn._writer
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(readable)


def sendable(conn: Any) -> bool:
    """May a connection held since its last pipeline (:class:`HeldConnections`) be written on as
    it is? What redis-py's pool checks before it hands a connection out (``ensure_connection``:
    connected, and ``can_read`` false — nothing left unread by its last user, the server has not
    closed it) and at its release (``should_reconnect``), plus an open transport, without the
    pool's lock and bookkeeping. False: back to the pool, whose checkout reconnects it or refuses it
    ("Connection has data") as before. Only with the hiredis parser (any other: False)."""
    stream = conn._reader
    if stream is None or conn._writer is None or conn.should_reconnect():
        return False
    parser = conn._parser
    if parser.__class__ is not _AsyncHiredisParser or parser._reader is None or parser._reader.has_data():
        return False
    return not (stream.at_eof() or len(stream._buffer) or conn._writer.transport.is_closing())


def closed_by_server(conn: Any) -> bool:
    """Is ``conn`` open on this side while the server has closed it (Redis restarted or stopped,
    its idle ``timeout``, ``CLIENT KILL``)? The event loop has read the connection's end of file
    (``StreamReader._eof``; unread bytes before it change nothing: no reply can follow them) or
    its transport is closing (reset, TLS closed). Attributes only, no system call: a close the
    event loop has not read yet is not seen (the write on it fails after it was sent)."""
    stream, writer = conn._reader, conn._writer
    if stream is None or writer is None:
        return False  # not connected: the checkout's connect() opens it
    return bool(stream._eof) or writer.transport.is_closing()


class ConnectionPool(_aconn.ConnectionPool):
    """redis-py's pool, whose checkout does not hand out a connection the server closed while it
    was idle (:func:`closed_by_server`): it is reconnected before anything is written on it.
    redis-py 8.1's ``ensure_connection`` reconnects a connection ``can_read()`` flags (at end of
    file, or bytes unread) only with maintenance notifications off — it speaks RESP3 and turns
    them on by default, since unread bytes may be a push to read before the next reply — so it
    handed such a connection out, and the pipeline written on it failed after it was sent
    (ambiguous). Bytes unread on an open connection are still handed out as redis-py does."""

    async def ensure_connection(self, connection: Any) -> None:
        if closed_by_server(connection):
            await connection.disconnect()  # the checkout's connect() opens it again
        await super().ensure_connection(connection)


class SentinelConnectionPool(ConnectionPool, _sentinel.SentinelConnectionPool):
    """:class:`ConnectionPool`'s checkout for a Sentinel-managed client (its reconnect asks the
    sentinels for the primary again: the override's ``super()`` is redis-py's Sentinel pool, then
    its pool). redis-py 8.1 builds a Sentinel pool with maintenance notifications off, so its own
    checkout reconnects such a connection already; this keeps it so should that change."""


class HeldConnections:
    """The connections one store node's pipelines keep between pipelines instead of a pool
    checkout and release each (the batcher's drain tasks send one pipeline after another; at
    most ``size`` are kept, the drain tasks' count). They stay checked out of the pool (counted
    in its ``max_connections`` and closed by its ``disconnect``); one that is not
    :func:`sendable` when taken, or that failed, goes back to the pool, and the pool's own
    checkout decides what happens to it — so a connection in any state the pool treats specially
    (unread bytes, marked to reconnect by a maintenance notification) is treated as before, and
    one the server closed is reconnected by the agent's pool (:class:`ConnectionPool`). Not held with a streaming credential provider (its re-authentication runs
    at the release)."""

    __slots__ = ("_idle", "pool", "size")

    def __init__(self, pool: Any, size: int):
        self.pool = pool
        self.size = size
        self._idle: list[Any] = []

    @classmethod
    def of(cls, client: Any, size: int) -> HeldConnections | None:
        """For a redis-py client whose pool allows holding (see the class); None otherwise."""
        pool = getattr(client, "connection_pool", None)
        if not isinstance(pool, _aconn.ConnectionPool) or size < 1:
            return None
        if isinstance(pool.connection_kwargs.get("credential_provider"), StreamingCredentialProvider):
            return None
        return cls(pool, size)

    def take(self) -> Any:
        """The last connection held, or None (none held: check one out of the pool). The caller
        checks it with :func:`sendable` and gives an unsendable one back to the pool."""
        return self._idle.pop() if self._idle else None

    def keep(self, conn: Any) -> bool:
        """Hold ``conn`` (a pipeline on it just ended, every reply read) for the next pipeline;
        False: not kept (not sendable, or enough held), the caller releases it to the pool."""
        if len(self._idle) >= self.size or not sendable(conn):
            return False
        self._idle.append(conn)
        return True

    async def drop(self) -> None:
        """Close every held connection and give it back to the pool (the store restarted or
        failed over: like the pool's idle connections, they most likely died with it)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                await conn.disconnect()
            except Exception:  # closing a dead socket: nothing to report
                pass
            await self.pool.release(conn)


__all__ = ["FAST_READS", "ConnectionPool", "HeldConnections", "RedisInternalsChanged", "SentinelConnectionPool",
           "answer_waiting", "closed_by_server", "missing", "read_replies", "sendable", "write_now"]
