"""The private parts of redis-py, hiredis and asyncio that region_agent.store.redis_internals
uses are all there in the installed versions, and the check names the one that is not: a
release that renames one fails here and stops the agent at start, never a silent slow path."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import textwrap
from types import SimpleNamespace

import hiredis
import pytest
import redis._parsers.hiredis as redis_hiredis
from redis.asyncio.connection import Connection, ConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool

from region_agent.store import redis_internals as ri
from region_agent.store.client import make_client, make_sentinel_client, parse_store_url


def test_every_private_part_is_there() -> None:
    assert ri.missing() == []


class _NoWriter(Connection):
    def __init__(self) -> None:
        super().__init__()
        del self._writer


class _Parser:
    def __init__(self, size: int) -> None:
        self.size = size  # no _reader


class _StreamWithoutBuffer(asyncio.StreamReader):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        del self._buffer


class _StreamWithoutEof(asyncio.StreamReader):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        del self._eof


def test_each_missing_part_is_named() -> None:
    assert ri.missing(connection_cls=_NoWriter) == ["redis.asyncio.Connection()._writer"]
    assert "_AsyncHiredisParser()._reader" in ri.missing(parser_cls=_Parser, default_parser=_Parser)
    assert ri.missing(default_parser=object) == [
        "redis.asyncio.connection.DefaultParser is not _AsyncHiredisParser (hiredis not used)"]
    old_hiredis = SimpleNamespace(Reader=SimpleNamespace(gets=hiredis.Reader.gets))
    assert ri.missing(hiredis_module=old_hiredis) == ["hiredis.PushNotification", "hiredis.Reader.has_data"]
    assert ri.missing(stream_reader_cls=_StreamWithoutBuffer) == ["asyncio.StreamReader()._buffer"]
    assert ri.missing(stream_reader_cls=_StreamWithoutEof) == ["asyncio.StreamReader()._eof"]


def test_importing_with_a_renamed_parser_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(redis_hiredis, "_AsyncHiredisParser")
    try:
        with pytest.raises(RuntimeError, match="_AsyncHiredisParser") as raised:
            importlib.reload(ri)  # the reload defines the exception class anew: matched by name
        assert type(raised.value).__name__ == "RedisInternalsChanged"
    finally:
        monkeypatch.undo()
        importlib.reload(ri)
    assert ri.missing() == []


def test_a_stand_in_connection_has_no_answer_waiting() -> None:
    assert ri.answer_waiting(object()) is False
    assert ri.answer_waiting(Connection()) is False  # never connected: no stream, no socket


class _OldPool:
    connection_kwargs: dict = {}  # no ensure_connection


def test_the_held_connections_parts_are_named_when_missing() -> None:
    assert ri.missing(pool_cls=_OldPool) == ["redis.asyncio.ConnectionPool.ensure_connection"]


def _called(method: object) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(method))))  # type: ignore[arg-type]  # a function
    return sorted({ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)})


def test_the_pools_checkout_and_release_do_only_what_a_held_connection_skips_or_checks() -> None:
    """HeldConnections keeps a node's pipeline connections out of the pool between pipelines and
    checks a held one with sendable() instead of the pool's checkout and release. That is right
    only while these do nothing else to a connection than what sendable() checks (connect when
    not connected, can_read, should_reconnect: an unsendable one goes back through the pool) and
    bookkeeping (observability counts, the release event's re-authentication, refused for a
    streaming credential provider). A redis-py release that changes them fails here: read them
    again before raising the version bound."""
    assert _called(ConnectionPool.get_connection) == [
        "deprecated_args", "get_pool_name", "len", "record_connection_count", "record_connection_create_time",
        "self.ensure_connection", "self.get_available_connection", "self.release", "time.monotonic"]
    assert _called(ConnectionPool.ensure_connection) == [
        "ConnectionError", "connection.can_read", "connection.connect", "connection.disconnect",
        "self.maint_notifications_enabled"]
    assert _called(ConnectionPool.release) == [
        "AsyncAfterConnectionReleasedEvent", "connection.disconnect", "connection.should_reconnect", "get_pool_name",
        "record_connection_count", "self._available_connections.append", "self._event_dispatcher.dispatch_async",
        "self._in_use_connections.remove"]
    assert _called(redis_hiredis._AsyncHiredisParser.can_read) == [
        "OSError", "bool", "self._reader.has_data", "self._stream.at_eof"]


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing


class _Conn:
    """A connection as the pool's checkout sees it: its stream and transport, what it was asked."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self._reader: asyncio.StreamReader | None = stream
        self.transport = _Transport()
        self._writer: SimpleNamespace | None = SimpleNamespace(transport=self.transport)
        self.calls: list[str] = []

    async def connect(self) -> None:
        self.calls.append("connect")

    async def disconnect(self) -> None:
        self.calls.append("disconnect")
        self._reader = self._writer = None

    async def can_read(self) -> bool:
        stream = self._reader
        return stream is not None and (stream.at_eof() or bool(stream._buffer))


async def test_closed_by_server_reads_the_streams_end_of_file_and_the_transport() -> None:
    conn = _Conn(asyncio.StreamReader())
    assert not ri.closed_by_server(conn)
    conn._reader.feed_data(b">2\r\n")  # type: ignore[union-attr]  # bytes unread (a push): not closed
    assert not ri.closed_by_server(conn)
    conn._reader.feed_eof()  # type: ignore[union-attr]  # and then the server's end of file
    assert ri.closed_by_server(conn)
    reset = _Conn(asyncio.StreamReader())
    reset.transport.closing = True
    assert ri.closed_by_server(reset)
    await conn.disconnect()
    assert not ri.closed_by_server(conn)  # not connected: the checkout's connect() opens it


async def _checkout_calls(pool: object, conn: _Conn) -> list[str]:
    await pool.ensure_connection(conn)  # type: ignore[attr-defined]  # a redis-py pool
    return conn.calls


def _closed() -> _Conn:
    conn = _Conn(asyncio.StreamReader())
    conn._reader.feed_eof()  # type: ignore[union-attr]  # the server closed it while it was idle
    return conn


async def test_the_agents_pools_reconnect_what_redis_pys_checkout_hands_out_closed() -> None:
    """With maintenance notifications on (redis-py 8's default for a redis:// URL), redis-py's
    checkout hands out a connection at end of file as it is; the agent's pools (standalone and
    Sentinel: region_agent.store.client) reconnect it first. A connection with unread bytes and
    no end of file (a push, read before the next reply) is handed out as by redis-py."""
    url = "redis://127.0.0.1:1/0"
    plain = ConnectionPool.from_url(url)
    assert plain.maint_notifications_enabled()
    assert await _checkout_calls(plain, _closed()) == ["connect"]  # why ri.ConnectionPool exists
    pools = [make_client(url).connection_pool,
             make_sentinel_client(parse_store_url("redis+sentinel://127.0.0.1:1/leasehold")).connection_pool]
    assert [type(p) for p in pools] == [ri.ConnectionPool, ri.SentinelConnectionPool]
    for pool in pools:
        assert await _checkout_calls(pool, _closed()) == ["disconnect", "connect"]
        pushed = _Conn(asyncio.StreamReader())
        pushed._reader.feed_data(b">2\r\n")  # type: ignore[union-attr]  # bytes unread (a push) on an open connection
        if pool.maint_notifications_enabled():
            assert await _checkout_calls(pool, pushed) == ["connect"]


def test_the_agents_pools_check_out_through_ensure_connection() -> None:
    """ri.ConnectionPool and ri.SentinelConnectionPool change only ensure_connection: redis-py's
    get_connection (which calls it: the test above) must be the one they run, also for Sentinel."""
    assert ri.ConnectionPool.get_connection is ConnectionPool.get_connection
    assert ri.SentinelConnectionPool.get_connection is ConnectionPool.get_connection
    assert SentinelConnectionPool.ensure_connection is ConnectionPool.ensure_connection
    assert issubclass(ri.SentinelConnectionPool, SentinelConnectionPool)


def test_the_sentinel_pool_is_the_agents_checkout_over_redis_pys_sentinel_pool() -> None:
    """One override of ensure_connection for both pools: the Sentinel pool's order of classes puts
    redis-py's Sentinel pool (its connection class and primary lookup) between it and redis-py's pool."""
    assert ri.SentinelConnectionPool.__mro__[1:4] == (ri.ConnectionPool, SentinelConnectionPool, ConnectionPool)
    assert ri.SentinelConnectionPool.ensure_connection is ri.ConnectionPool.ensure_connection
