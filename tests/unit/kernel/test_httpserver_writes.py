"""kernel.httpserver: an answer's head and its first body part leave in one ``write``, through
uvicorn's own protocol and cycle (this fails when uvicorn changes how a cycle writes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from uvicorn.server import ServerState

from kernel.httpserver import BoundedHttpToolsProtocol, LimitedConfig, OneWriteCycle
from tests.support.transport import RecordingTransport


def answer_with(*messages: dict, fail: bool = False):
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        for m in messages:
            await send(m)
        if fail:
            raise RuntimeError("the application failed after starting its answer")

    return app


START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")]}
BODY = {"type": "http.response.body", "body": b'{"ok":true}'}


@dataclass
class Served:
    writes: list[bytes]  # what the connection's socket received: one entry per write
    closed: bool  # the server closed the connection (before it was lost)


def serve(app: Any, request: bytes) -> Served:
    async def run() -> Served:
        config = LimitedConfig(app, lifespan="off", access_log=False, log_level="warning")
        config.load()
        proto = BoundedHttpToolsProtocol(config, ServerState(), {}, asyncio.get_running_loop())
        t = RecordingTransport()
        proto.connection_made(t)  # type: ignore[arg-type]  # a recording stand-in for the transport
        proto.data_received(request)
        assert isinstance(proto.cycle, OneWriteCycle)
        for _ in range(20):  # the application's task runs
            await asyncio.sleep(0)
        served = Served(t.writes, t.closed)
        proto.connection_lost(None)
        assert t.late == [], "written after the close"
        return served

    return asyncio.run(run())


POST = b"POST /v1/admit HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"


def test_head_and_body_leave_in_one_write() -> None:
    t = serve(answer_with(START, BODY), POST)
    assert len(t.writes) == 1
    head, _, body = t.writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 11" in head
    assert body == b'{"ok":true}'
    assert not t.closed  # keep-alive as before


def test_pipelined_requests_are_answered_in_order_one_write_each() -> None:
    t = serve(answer_with(START, BODY), POST + POST)
    assert len(t.writes) == 2
    assert all(w.startswith(b"HTTP/1.1 200 OK\r\n") and w.endswith(b'{"ok":true}') for w in t.writes)


def test_a_streamed_body_writes_its_later_parts_as_they_come() -> None:
    chunked = {"type": "http.response.start", "status": 200, "headers": []}
    t = serve(answer_with(chunked, {"type": "http.response.body", "body": b"ab", "more_body": True},
                          {"type": "http.response.body", "body": b"cd"}), POST)
    assert len(t.writes) == 2
    assert b"transfer-encoding: chunked" in t.writes[0] and t.writes[0].endswith(b"\r\n\r\n2\r\nab\r\n")
    assert t.writes[1] == b"2\r\ncd\r\n0\r\n\r\n"


def test_a_head_request_gets_its_head() -> None:
    t = serve(answer_with(START, {"type": "http.response.body", "body": b""}),
              b"HEAD /x HTTP/1.1\r\nhost: x\r\n\r\n")
    assert len(t.writes) == 1 and t.writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and t.writes[0].endswith(b"\r\n\r\n")


def test_connection_close_answer_is_written_before_the_close() -> None:
    t = serve(answer_with(START, BODY), b"POST /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}")
    assert len(t.writes) == 1 and t.writes[0].endswith(b'{"ok":true}') and t.closed


@pytest.mark.parametrize("messages", [(START,), ()])
def test_an_application_that_fails_or_returns_early_closes_the_connection(messages: tuple) -> None:
    """Started and never finished: the connection is closed, as uvicorn does; nothing half-written
    is followed by another answer."""
    t = serve(answer_with(*messages, fail=True), POST)
    assert t.closed
    if not messages:  # nothing started: uvicorn's 500
        assert len(t.writes) == 1 and t.writes[0].startswith(b"HTTP/1.1 500 ")
