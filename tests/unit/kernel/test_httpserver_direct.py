"""kernel.httpserver's direct routes: a POST the protocol answers itself, driven through uvicorn's
own protocol with a recording transport. What must hold: answers in request order (pipelined
requests behind a direct one wait), a refused body handed to the application exactly as uvicorn
would have given it, keep-alive and close as uvicorn does them, nothing written to a connection
that went away, and only the requests the module's docstring names taken directly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from uvicorn.server import ServerState

from kernel.httpserver import Answer, BoundedHttpToolsProtocol, HttpLimits, LimitedConfig
from tests.support.transport import RecordingTransport


class Route:
    """Answers ``{"echo": <body>}``; refuses (hands over) a body that is ``bad``; ``gate``: answers
    wait for it (a decision waiting on its store)."""

    def __init__(self) -> None:
        self.admitted: list[list[tuple[bytes, bytes]]] = []
        self.answered: list[bytes] = []
        self.gate: asyncio.Event | None = None
        self.admit = True

    def admits(self, headers: list[tuple[bytes, bytes]]) -> bool:
        self.admitted.append(headers)
        return self.admit

    def answer(self, headers: list[tuple[bytes, bytes]], body: bytes) -> Awaitable[Answer] | None:
        if body == b"bad":
            return None
        if body == b"boom":
            raise RuntimeError("a bug in the route")
        return self._answer(body)

    async def _answer(self, body: bytes) -> Answer:
        if self.gate is not None:
            await self.gate.wait()
        if body == b"fail":
            raise RuntimeError("a bug while deciding")
        self.answered.append(body)
        return 200, [(b"content-type", b"application/json")], b'{"echo":"' + body + b'"}'


async def app(scope: dict, receive: Any, send: Any) -> None:
    """The application: answers 299 with what it received (so a handed-over request shows)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    payload = b"app:" + scope["method"].encode() + b" " + scope["path"].encode() + b" " + body
    await send({"type": "http.response.start", "status": 299,
                "headers": [(b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def post(body: bytes, target: bytes = b"/direct", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST " + target + b" HTTP/" + version + b"\r\nhost: x\r\ncontent-length: %d\r\n" % len(body)
            + extra + b"\r\n" + body)


GET = b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n"


class Conn:
    def __init__(self, route: Route, **config: Any) -> None:
        self.route = route
        cfg = LimitedConfig(app, lifespan="off", log_level="warning", direct=lambda _app: {b"/direct": route},
                            limits=HttpLimits(header_timeout_s=0.2, body_timeout_s=0.2), **config)
        cfg.load()
        self.state = ServerState()
        self.state.default_headers = [(b"date", b"Sat, 05 Dec 2026 00:00:00 GMT"), (b"server", b"test")]
        self.proto = BoundedHttpToolsProtocol(cfg, self.state, {}, asyncio.get_running_loop())
        self.t = RecordingTransport()
        self.proto.connection_made(self.t)  # type: ignore[arg-type]  # a recording stand-in for the transport

    async def feed(self, data: bytes, turns: int = 30) -> None:
        self.proto.data_received(data)
        await self.settle(turns)

    async def settle(self, turns: int = 30) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)

    def answers(self) -> list[tuple[int, bytes]]:
        """(status, body) per answer in the bytes written so far (none after a close)."""
        assert self.t.late == []
        data = b"".join(self.t.writes)
        out = []
        while data:
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split()[1])
            length = next((int(v) for n, _, v in (ln.partition(b": ") for ln in lines[1:]) if n == b"content-length"), 0)
            out.append((status, rest[:length]))
            data = rest[length:]
        return out


async def test_a_direct_answer_is_one_write_with_the_servers_default_headers() -> None:
    c = Conn(Route())
    await c.feed(post(b"a1"))
    assert c.t.writes == [b"HTTP/1.1 200 OK\r\ndate: Sat, 05 Dec 2026 00:00:00 GMT\r\nserver: test\r\n"
                          b"content-type: application/json\r\ncontent-length: 13\r\n\r\n{\"echo\":\"a1\"}"]
    assert not c.t.closed and c.state.total_requests == 1 and not c.state.tasks


async def test_pipelined_requests_are_answered_in_order_behind_a_waiting_direct_one() -> None:
    route = Route()
    route.gate = asyncio.Event()
    c = Conn(route)
    await c.feed(post(b"a1") + GET + post(b"a2") + post(b"bad") + post(b"a3", target=b"/direct?x=1"))
    assert c.t.writes == []  # the first waits, everything behind it waits too
    route.gate.set()
    await c.settle(200)
    # a request whose head ends while another is in flight is the application's, in its turn
    assert c.answers() == [(200, b'{"echo":"a1"}'), (299, b"app:GET /other "), (299, b"app:POST /direct a2"),
                           (299, b"app:POST /direct bad"), (299, b"app:POST /direct a3")]
    assert not c.t.closed
    await c.feed(post(b"a4"))  # nothing in flight any more: direct again
    assert c.answers()[-1] == (200, b'{"echo":"a4"}')


async def test_a_body_the_route_refuses_reaches_the_application_whole() -> None:
    c = Conn(Route())
    await c.feed(post(b"bad")[:-2])  # the body arrives in two reads
    await c.feed(b"ad")
    assert c.answers() == [(299, b"app:POST /direct bad")]
    await c.feed(post(b"a1"))  # the connection goes on
    assert c.answers()[1] == (200, b'{"echo":"a1"}')


async def test_what_is_not_taken_directly() -> None:
    route = Route()
    c = Conn(route)
    await c.feed(post(b"q", target=b"/direct?x=1"))
    await c.feed(post(b"e", extra=b"expect: 100-continue\r\n"))
    await c.feed(b"PUT /direct HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\np")
    route.admit = False
    await c.feed(post(b"n"))
    assert [a[0] for a in c.answers() if a[0] != 100] == [299, 299, 299, 299]
    assert route.answered == []
    assert len(route.admitted) == 1  # asked only for the POST to the exact target


@pytest.mark.parametrize("extra, version", [(b"connection: close\r\n", b"1.1"), (b"", b"1.0")])
async def test_connection_close_and_http_1_0_close_after_the_answer(extra: bytes, version: bytes) -> None:
    c = Conn(Route())
    await c.feed(post(b"a1", extra=extra, version=version))
    assert c.answers() == [(200, b'{"echo":"a1"}')]
    assert b"connection: close\r\n" in c.t.writes[0] and c.t.closed


async def test_a_client_gone_before_the_answer_gets_nothing_written() -> None:
    route = Route()
    route.gate = asyncio.Event()
    c = Conn(route)
    await c.feed(post(b"a1"))
    c.proto.connection_lost(None)  # closes the transport, as the loop does
    route.gate.set()
    await c.settle()
    assert c.t.writes == [] and not c.state.tasks
    assert route.answered == [b"a1"]  # decided (the store was asked), just not written


async def test_a_slow_body_gets_408_and_a_close() -> None:
    route = Route()
    c = Conn(route)
    await c.feed(post(b"a1")[:-1])
    await asyncio.sleep(0.5)  # the body deadline is 0.2 s
    assert c.t.closed and c.t.writes[0].startswith(b"HTTP/1.1 408 ")
    assert route.answered == []


async def test_a_route_that_fails_answers_500_or_hands_over() -> None:
    c = Conn(Route())
    await c.feed(post(b"fail"))  # while deciding: 500
    await c.feed(post(b"boom"))  # before deciding: the application answers
    await c.feed(post(b"a1"))
    assert [a[0] for a in c.answers()] == [500, 299, 200]


async def test_a_graceful_shutdown_closes_after_the_pending_answer() -> None:
    route = Route()
    route.gate = asyncio.Event()
    c = Conn(route)
    await c.feed(post(b"a1"))
    c.proto.shutdown()
    assert not c.t.closed
    route.gate.set()
    await c.settle()
    assert c.answers() == [(200, b'{"echo":"a1"}')] and c.t.closed
    assert b"connection: close\r\n" in c.t.writes[0]


async def test_no_direct_route_with_an_access_log_or_a_concurrency_limit() -> None:
    route = Route()
    c = Conn(route, limit_concurrency=100)
    await c.feed(post(b"a1"))
    assert c.answers() == [(299, b"app:POST /direct a1")] and route.admitted == []


async def test_a_client_that_does_not_read_meets_flow_control() -> None:
    """Writes paused (the client's window and the transport's buffer full): the request goes to
    the application, whose answer waits for the client to read and whose connection stops reading."""
    route = Route()
    c = Conn(route)
    c.proto.pause_writing()
    await c.feed(post(b"a1"))
    assert c.t.writes == [] and route.admitted == []
    c.proto.resume_writing()
    await c.settle()
    assert c.answers() == [(299, b"app:POST /direct a1")]


async def test_a_route_that_fails_judging_a_head_leaves_it_to_the_application() -> None:
    route = Route()

    def broken(headers: list) -> bool:
        raise RuntimeError("a bug judging the head")

    route.admits = broken  # type: ignore[method-assign]  # a route whose check fails
    c = Conn(route)
    await c.feed(post(b"a1"))
    assert c.answers() == [(299, b"app:POST /direct a1")]
