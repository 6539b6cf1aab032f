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

from region_agent.store import redis_internals as ri


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


def test_each_missing_part_is_named() -> None:
    assert ri.missing(connection_cls=_NoWriter) == ["redis.asyncio.Connection()._writer"]
    assert "_AsyncHiredisParser()._reader" in ri.missing(parser_cls=_Parser, default_parser=_Parser)
    assert ri.missing(default_parser=object) == [
        "redis.asyncio.connection.DefaultParser is not _AsyncHiredisParser (hiredis not used)"]
    old_hiredis = SimpleNamespace(Reader=SimpleNamespace(gets=hiredis.Reader.gets))
    assert ri.missing(hiredis_module=old_hiredis) == ["hiredis.PushNotification", "hiredis.Reader.has_data"]
    assert ri.missing(stream_reader_cls=_StreamWithoutBuffer) == ["asyncio.StreamReader()._buffer"]


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
