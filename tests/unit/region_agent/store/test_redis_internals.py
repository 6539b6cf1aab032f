"""The private parts of redis-py, hiredis and asyncio that region_agent.store.redis_internals
uses are all there in the installed versions, and the check names the one that is not: a
release that renames one fails here and stops the agent at start, never a silent slow path."""

from __future__ import annotations

import asyncio
import importlib
from types import SimpleNamespace

import hiredis
import pytest
import redis._parsers.hiredis as redis_hiredis
from redis.asyncio.connection import Connection

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
