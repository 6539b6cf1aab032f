"""How both services are served: uvicorn with httptools, plus the limits a public-facing HTTP
server needs and uvicorn does not enforce.

uvicorn's httptools protocol keeps appending to a request's head for as long as the client sends
it (one 256 MiB header grew an agent by 265 MiB and stalled ``/healthz`` for seconds), counts no
headers and has no deadline for a head or a body, so a client that trickles bytes holds its
connection forever. :class:`BoundedHttpToolsProtocol` is uvicorn's protocol with, per request:

* **head size** — request line and headers together at most ``max_header_bytes``; a longer head
  is answered ``431`` and the connection closed. While a head is still arriving it is counted
  per read, so what the server buffers for one connection is bounded by the limit plus one read
  (uvloop reads at most 256 KB); a complete head is measured exactly (URL plus every name and
  value, 4 bytes of separators each);
* **header count** — more than ``max_headers`` fields: ``431``;
* **head deadline** — the head must be complete ``header_timeout_s`` after the connection opened
  or the request's first byte arrived, else ``408`` and close (a connection that sent nothing is
  closed silently); idle keep-alive connections are closed by uvicorn after its keep-alive
  timeout;
* **body deadline** — a request's body must be complete ``body_timeout_s`` after its head, else
  ``408`` (or a plain close once the answer has started) and the connection is closed;
* **write deadline** — once a connection's answers fill the socket buffers (the transport pauses
  writing: the client does not read them), the client must take enough of them for writing to
  resume within ``write_timeout_s``, else the connection is aborted (reset: a close would wait
  for the very bytes the client does not take). Without it a client that sends requests and
  never reads an answer held its connection, and the task writing its answer, for as long as it
  kept the socket open: every other deadline is asleep while an answer waits to be written.

Per process, not per request: **open connections** — at most ``max_connections``; one accepted
beyond them is answered ``503`` (problem+json, ``Retry-After: 1``) at once, before anything of it
is read, and closed (:class:`ConnectionCap`: one log line when the process starts refusing, one
when it is below the cap again; its refused count and the open connections are read by the
services' metrics at collection, :func:`serving_cap`). Without it a client opened connections
until the process ran out of file descriptors, and then the process could open none of its own
(Redis, etcd) either.
Connections already open are never touched by it. uvicorn's ``limit_concurrency`` was not used:
it accepts every connection and answers each request on them 503 (a connection held idle counts
and is never refused), and it turns off the direct routes. :func:`serve` also raises the
process's soft ``RLIMIT_NOFILE`` to its hard limit (logged when that leaves less than the caps
need).

The answers are ``application/problem+json`` written by the protocol itself: the application
never sees such a request. Everything else is uvicorn's code; the hot path adds a few counter
updates and one timer per request (``make bench`` figure 2 measures it, see the README).

A request asking for a protocol upgrade (``Connection: Upgrade``) is served as plain HTTP, as
uvicorn does when it has no protocol to upgrade to, but noted in the log at most once a second
(uvicorn wrote two WARNING lines per such request, any client's). Such a request with a body is
``400`` and the connection closed: the parser stops at the end of an upgrade's head, so the body
was never read and the route answered as if none had been sent.

One thing the protocol changes in how an answer leaves: uvicorn writes an answer's head when the
application sends ``http.response.start`` and its body when it sends ``http.response.body``, two
``write`` calls and two TCP segments for every answer. :class:`OneWriteCycle` holds the head
until the first body part and writes both at once (a raw ASGI echo under figure 2's load: 17 %
more answers a second, 5 us less CPU per answer; the client reads one segment instead of two).
Nothing else about the answer changes: the same bytes in the same order, and a head whose body
never comes is written when the connection is closed, as before.

**Direct routes.** A service may name requests the protocol answers itself, without ASGI
(``serve(direct=...)``: a function from the loaded application to a mapping of request targets to
:class:`DirectRoute`). uvicorn's ASGI machinery — the scope, a request/response cycle with its
event, the ``receive`` and ``send`` coroutines, the application's own call chain — costs about as
much per request as the whole of a small answer (in process: 14-18 us of uvicorn's protocol with a
trivial application, against about 6 for the parse and one write). A request is answered
directly only when all of this holds at the end of its head: ``POST`` to exactly a named target
(no query), nothing else in flight on the connection, the connection's writes not paused (a
client that does not read its answers meets uvicorn's flow control, as on every other request),
no ``Expect: 100-continue``, no upgrade, and the route admits the head (``DirectRoute.admits``: e.g. content type, announced length,
credentials). Its body is then read by the protocol; at its end ``DirectRoute.answer`` either
returns the awaitable answer — written in one write with the same default headers, keep-alive
and ``Connection: close`` handling as uvicorn's — or ``None``: the request is then handed to the
application exactly as uvicorn would have (its cycle made, the body as read), so every refusal
keeps the application's one code path. A pipelined request behind a directly answered one waits
for it, as behind any other. Never direct: a server with uvicorn's concurrency limit, access log
or root path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from .ratelog import KeyedLog, TransitionLog

log = logging.getLogger(__name__)
_ignored_upgrades = KeyedLog(log, interval_s=1.0)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
_CODES = {400: "bad-request", 408: "request-timeout", 431: "header-fields-too-large", 503: "too-many-connections"}


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024  # request line + headers
    max_headers: int = 100  # header fields per request
    header_timeout_s: float = 10.0  # connection open / first byte of a request -> head complete
    body_timeout_s: float = 10.0  # head complete -> body complete
    write_timeout_s: float = 10.0  # writes paused (the client takes no answer bytes) -> connection aborted
    max_connections: int = 1_000  # open connections per process; one more is answered 503 and closed
    keepalive_s: float = 120.0  # a connection idle this long between requests is closed (uvicorn's 5 s was
    # shorter than the gateways' pooled connections stay idle: a request on one the agent was closing
    # failed); above every shipped gateway's idle timeout, Traefik's 90 s included (decision 0093)


class _Refuse(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _problem(status: int, detail: str, retry_after_s: int | None = None) -> bytes:
    body = json.dumps({"type": "https://leasehold.dev/problems/" + _CODES[status], "title": _REASONS[status].decode(),
                       "status": status, "detail": detail, "retriable": retry_after_s is not None}).encode()
    retry = b"" if retry_after_s is None else b"retry-after: %d\r\n" % retry_after_s
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
                     b"content-type: application/problem+json\r\n", retry,
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body), body])


class ConnectionCap:
    """The most connections one process keeps open (``HttpLimits.max_connections``), and the
    lines an operator reads: one WARNING when the process starts refusing connections, one
    INFO (with how many it refused) once it is below the cap again, at most one line each
    ``interval_s`` — never a line per connection. One per process (a worker has its own), shared
    by its connections through the config. ``refused`` and :attr:`open` are what the services'
    metrics export (kernel.connection_metrics), read at collection."""

    def __init__(self, limit: int, interval_s: float = 10.0, connections: Sized = ()):
        self.limit = limit
        self.refused = 0  # connections refused since the process started
        self.connections = connections  # uvicorn's set of the server's open connections (refused ones until closed)
        self._reported = 0  # ``refused`` when the last "below the cap" line was written
        self._log = TransitionLog(log, initial=False, interval_s=interval_s)
        self.refusing = False  # the last line said "refusing"
        self._retry: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        """Connections open now (read by the services' metrics at collection, never counted)."""
        return len(self.connections)

    def at_limit(self, open_connections: int) -> bool:
        """A connection was just accepted, ``open_connections`` with it: refuse it?"""
        if open_connections <= self.limit:
            return False
        self.refused += 1
        if not self.refusing:
            self.refusing = self._log.observe(True, self._line)
        return True

    def released(self, open_connections: Callable[[], int]) -> None:
        """A connection closed while the process was refusing; ``open_connections()``: how many
        remain. A line not due yet (the last one is recent) is tried again when it is."""
        if self._retry is not None or open_connections() >= self.limit:
            return
        self.refusing = not self._log.observe(False, self._line)
        if self.refusing:
            self._retry = asyncio.get_running_loop().call_later(self._log.interval_s, self._again, open_connections)

    def _again(self, open_connections: Callable[[], int]) -> None:
        self._retry = None
        if self.refusing:
            self.released(open_connections)

    def _line(self, refusing: Hashable, _changes: int) -> tuple[int, str]:
        if refusing:
            return logging.WARNING, (f"HTTP connections at the cap of {self.limit} open (--http-max-connections): "
                                     "new connections are answered 503 and closed")
        refused, self._reported = self.refused - self._reported, self.refused
        return logging.INFO, f"HTTP connections below the cap of {self.limit} again; {refused} refused meanwhile"


Headers = list[tuple[bytes, bytes]]
Answer = tuple[int, Headers, bytes]  # status, headers (lower-case names; no content-length), body


class DirectRoute(Protocol):
    """A ``POST`` the HTTP protocol answers itself (the module's "Direct routes")."""

    def admits(self, headers: Headers) -> bool:
        """At the end of the head: answer this request directly (the body is then read for it)?"""
        ...

    def answer(self, headers: Headers, body: bytes) -> Awaitable[Answer] | None:
        """With the whole body: the answer, or None to hand the request to the application."""
        ...


DirectRoutes = Callable[[Any], Mapping[bytes, DirectRoute] | None]  # loaded app -> routes by request target


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config carrying :class:`HttpLimits` and the direct routes' resolver (pickled to
    worker processes with it)."""

    def __init__(self, *args: Any, limits: HttpLimits | None = None, direct: DirectRoutes | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.leasehold_limits = limits or HttpLimits()
        self.leasehold_direct = direct
        self.leasehold_cap: ConnectionCap | None = None  # made in the serving process (a worker: its own)

    def connection_cap(self, connections: Sized = ()) -> ConnectionCap:
        """The serving process's cap, made at its first connection with uvicorn's set of the
        server's connections (``connections``), and from then on :func:`serving_cap`."""
        cap = self.leasehold_cap
        if cap is None:
            global _serving
            cap = self.leasehold_cap = _serving = ConnectionCap(self.leasehold_limits.max_connections,
                                                                connections=connections)
        return cap


_serving: ConnectionCap | None = None


def serving_cap() -> ConnectionCap | None:
    """The :class:`ConnectionCap` of the HTTP server this process serves (:func:`serve`; a worker:
    its own), None before its first connection: what the services' metrics read at collection
    (kernel.connection_metrics). A process serves one; of several in-process servers (tests), the
    one that made its cap last."""
    return _serving


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head size/count limits and head/body deadlines.

    One lazily re-armed timer per connection serves both deadlines: the hot path only moves
    ``_deadline`` (a request that arrives in one read costs no timer operation at all once the
    connection's timer is armed); the timer re-arms itself while the deadline lies ahead."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        lim: HttpLimits = getattr(config, "leasehold_limits", None) or HttpLimits()
        self._max_head = lim.max_header_bytes
        self._max_count = lim.max_headers
        self._head_timeout = lim.header_timeout_s
        self._body_timeout = lim.body_timeout_s
        self._write_timeout = lim.write_timeout_s
        self._cap: ConnectionCap = (config.connection_cap(server_state.connections) if isinstance(config, LimitedConfig)
                                    else ConnectionCap(lim.max_connections))
        self._stall: asyncio.TimerHandle | None = None  # armed while the transport has paused writing
        self._running: Any = None  # the cycle whose application task was started last (one at a time)
        self._phase = _HEAD  # waiting for (the rest of) a head, for a body, or idle between requests
        self._deadline = 0.0  # loop time at which the current phase times out
        self._timer: asyncio.TimerHandle | None = None
        self._began = False  # the current head's first byte arrived
        self._head_read = 0  # bytes of earlier reads of the pending head (bounds buffering)
        self._read_len = 0  # bytes of the read being parsed
        self._count_read = True  # False for the read a pipelined head began in (offset unknown)
        self._inexact = False  # a read of this head was not counted: measure the complete head exactly
        self._completed_in_read = False
        self._refused = False
        resolve: DirectRoutes | None = getattr(config, "leasehold_direct", None)
        direct_ok = (resolve is not None and self.limit_concurrency is None and not self.root_path
                     and not (self.access_log and self.access_logger.isEnabledFor(logging.INFO)))
        self._routes = resolve(self.app) if direct_ok and resolve is not None else None
        self._direct: DirectRoute | None = None  # the request being read is answered by this route
        self._direct_body = b""
        self._before: Any = None  # the connection's cycle before the direct request's stand-in

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # asyncio's servers hand a stream protocol a Transport
        super().connection_made(transport)
        if self._cap.at_limit(len(self.connections)):
            # past the process's cap: answered at once and closed, before anything is read (a
            # client that sends its request sees the answer; the connection costs nothing more)
            self._refused = True
            transport.write(_OVER_CAP)
            transport.close()
            return
        self._deadline = self.loop.time() + self._head_timeout
        self._timer = self.loop.call_at(self._deadline, self._on_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._cap.refusing:
            connections = self.connections
            self._cap.released(lambda: len(connections) - (self in connections))  # uvicorn's (below) forgets it
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        running = self._running
        if running is not None and not running.response_complete:
            # uvicorn marks only the connection's newest cycle: the one answering while pipelined
            # requests wait would wake from its wait for the drain and write on the closed transport
            running.disconnected = True
            running.message_event.set()
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self._write_timeout, self._on_write_stall)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        self._completed_in_read = False
        self._read_len = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            elif any(n == b"transfer-encoding" or (n == b"content-length" and v.strip(b" \t") != b"0")
                     for n, v in self.headers):
                # the parser stopped at the end of the head: the body was never read, and the
                # route saw none (answering as if none had been sent)
                self._refuse(400, "a request asking for a protocol upgrade cannot carry a body: no upgrade is served")
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, _Refuse):
                self._refuse(e.__context__.status, e.__context__.detail)
            else:
                self._refuse(400, "invalid HTTP request")
            return
        if self._began and self._phase == _HEAD:  # a head is still arriving
            if self._count_read:
                self._head_read += len(data)
                if self._head_read > self._max_head:
                    self._refuse(431, f"request head larger than {self._max_head} bytes")
            else:
                self._count_read = True
                self._inexact = True

    def _unsupported_upgrade_warning(self) -> None:
        """A request asking for a protocol upgrade, which neither service serves: it is served as
        plain HTTP. uvicorn's two WARNING lines for every such request (one telling the operator to
        install a WebSocket library) let any client write two log lines per request: one line a
        second at most, at INFO."""
        _ignored_upgrades.log("upgrade", logging.INFO, "ignored a request's Upgrade header: no protocol upgrade "
                                                       "is served here")

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase != _HEAD:  # not the connection's first request: its own head deadline
            self._phase = _HEAD
            self._deadline = self.loop.time() + self._head_timeout
            if self._timer is None:
                self._timer = self.loop.call_at(self._deadline, self._on_deadline)
        self._began = True
        self._head_read = 0
        self._inexact = False
        # a head that begins after another request ended in the same read starts at an unknown
        # offset of it: that read is not counted (the complete head is measured exactly below)
        self._count_read = not self._completed_in_read

    def on_headers_complete(self) -> None:
        if len(self.headers) > self._max_count:
            raise _Refuse(431, f"more than {self._max_count} header fields")
        if self._inexact or self._head_read + self._read_len > self._max_head:  # exact size only when it may matter
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if size > self._max_head:
                raise _Refuse(431, f"request head larger than {self._max_head} bytes")
        self._phase = _BODY
        self._began = False
        self._deadline = self.loop.time() + self._body_timeout
        routes = self._routes
        if routes is not None:
            route = routes.get(self.url)
            cycle = self.cycle
            if (route is not None and (cycle is None or cycle.response_complete) and not self.expect_100_continue
                    and not self.flow.write_paused and self.parser.get_method() == b"POST"
                    and not self.parser.should_upgrade() and self._admits(route)):
                self._direct = route
                self._before = cycle
                self.cycle = _Answering(self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive())  # type: ignore[assignment]  # uvicorn's code reads the same attributes
                return
        self._start_cycle()

    def _admits(self, route: DirectRoute) -> bool:
        try:
            return route.admits(self.headers)
        except Exception:  # a bug in the route: the application answers
            log.exception("direct route failed judging %r; handing the request to the application", self.url)
            return False

    def _start_cycle(self) -> None:
        """uvicorn makes the request's cycle and starts (or queues) its application task."""
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.__class__ is RequestResponseCycle:
            # the cycle uvicorn just made (its task has not run yet): answer in one write
            cycle.__class__ = OneWriteCycle

    def on_body(self, body: bytes) -> None:
        if self._direct is not None:
            self._direct_body += body  # at most the announced length the route admitted
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._completed_in_read = True
        self._phase = _IDLE
        route = self._direct
        if route is None:
            super().on_message_complete()
            return
        self._direct = None
        body, self._direct_body = self._direct_body, b""
        answering = self.cycle
        try:
            pending = route.answer(self.headers, body)
        except Exception:  # a bug in the route: the application answers instead
            log.exception("direct route failed on %r; handing the request to the application", self.url)
            pending = None
        if pending is None:  # the application answers, exactly as if it had had the request all along
            self.cycle = self._before
            self._start_cycle()
            if body:
                super().on_body(body)
            super().on_message_complete()
            return
        task = self.loop.create_task(self._answer_directly(answering, pending))  # type: ignore[arg-type]  # answering is the _Answering set at the head's end
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    async def _answer_directly(self, answering: _Answering, pending: Awaitable[Answer]) -> None:
        try:
            status, headers, payload = await pending
        except Exception:
            log.exception("direct route failed answering a request")
            status, headers, payload = 500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error"
        if answering.disconnected or self.transport.is_closing():
            answering.response_complete = True
            return
        keep = answering.keep_alive
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n" % len(payload))
        if not keep:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", payload)
        answering.response_started = answering.response_complete = True
        self.transport.write(b"".join(parts))
        if not keep:
            self.transport.close()
        self.on_response_complete()  # uvicorn's: a pipelined request starts, or the keep-alive timer

    # ------------------------------------------------------------------ deadlines and refusals
    def _on_deadline(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._phase == _IDLE:
            return  # between requests: uvicorn's keep-alive timeout closes an idle connection
        if self.loop.time() < self._deadline or (self._phase == _BODY and self.pipeline):
            # not yet (the deadline moved), or a pipelined request whose body cannot arrive before
            # the one ahead of it is answered (reading is paused meanwhile)
            self._timer = self.loop.call_at(max(self._deadline, self.loop.time() + 0.05), self._on_deadline)
            return
        if self._phase == _HEAD:
            if self._began:
                self._refuse(408, f"request head not complete within {self._head_timeout:g} s")
            else:  # opened and sent nothing
                self._refused = True
                self.transport.close()
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._refuse(408, f"request body not complete within {self._body_timeout:g} s")
        else:
            self._refused = True
            self.transport.close()

    def _on_write_stall(self) -> None:
        """Writes stayed paused for ``write_timeout_s``: the client does not read its answers.
        Aborted, not closed: a close waits until the buffered answers are written, which a client
        that reads nothing never lets happen (also a close begun earlier, by a deadline)."""
        self._stall = None
        if not self.flow.write_paused:
            return
        log.debug("aborted the connection of %s: its answers were not read within %g s", self.client,
                  self._write_timeout)
        self._refused = True
        self.transport.abort()  # connection_lost follows: uvicorn releases the cycle waiting to write

    def _refuse(self, status: int, detail: str) -> None:
        """Answer ``status`` (problem+json) unless an answer already started, and close."""
        if self._refused:
            return
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            started = cycle.response_started
            cycle.disconnected = True  # the application's receive() sees a disconnect, send() is dropped
            cycle.message_event.set()
            if started:
                self.transport.close()
                return
        log.debug("refused %s from %s: %s", status, self.client, detail)
        if not self.transport.is_closing():
            self.transport.write(_problem(status, detail))
            self.transport.close()


_HEAD, _BODY, _IDLE = 0, 1, 2
_OVER_CAP = _problem(503, "this server has as many connections open as it keeps; retry on another or later",
                     retry_after_s=1)


class _NoEvent:
    def set(self) -> None:
        pass


class _Answering:
    """Stands in for uvicorn's request/response cycle while the protocol answers a request itself:
    uvicorn's code (a pipelined request queued behind it, ``connection_lost``, ``shutdown``) and the
    deadlines read and set the same attributes."""

    __slots__ = ("keep_alive", "disconnected", "response_started", "response_complete")
    message_event = _NoEvent()

    def __init__(self, keep_alive: bool) -> None:
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_started = False
        self.response_complete = False


class _HeldHead:
    """The connection's transport as an answer's cycle sees it once the answer has started: the
    first write (the head uvicorn built) is kept, and leaves with the next one (the first body
    part) in a single ``write``; every later write passes through. Closed with the head still
    kept (an answer whose body never came), it writes the head first, as uvicorn would have.
    Anything else is the transport's."""

    __slots__ = ("transport", "head", "taken")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.head = b""
        self.taken = False  # the head was captured

    def write(self, data: bytes) -> None:
        if not self.taken:
            self.taken = True
            self.head = data
        elif self.head:
            head, self.head = self.head, b""
            self.transport.write(head + data)
        else:
            self.transport.write(data)

    def close(self) -> None:
        if self.head and not self.transport.is_closing():
            self.transport.write(self.head)
        self.head = b""
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request/response cycle whose answer's head and first body part leave in one
    ``write`` (see the module's docstring). uvicorn's ``send`` does all the checking and framing;
    this class only changes what ``self.transport`` is while it does. Not held: the answer to a
    ``HEAD`` request (uvicorn writes no body part for it) and a head sent while the connection's
    writes are paused (the hold would change nothing)."""

    async def send(self, message: Any) -> None:
        if (self.response_started or message["type"] != "http.response.start" or self.disconnected
                or self.flow.write_paused or self.scope["method"] == "HEAD"):
            await RequestResponseCycle.send(self, message)
            return
        real = self.transport
        self.transport = _HeldHead(real)  # type: ignore[assignment]  # stands in for the transport (write, close, the rest delegated)
        try:
            await RequestResponseCycle.send(self, message)  # builds and checks the head; _HeldHead.write keeps it
        except BaseException:
            self.transport = real
            raise


def serve(app: Any, *, host: str, port: int, limits: HttpLimits, log_level: str, access_log: bool = False,
          workers: int = 1, factory: bool = False, ssl_certfile: str | None = None,
          ssl_keyfile: str | None = None, log_config: dict[str, Any] | None = None,
          proxy_headers: bool = True, direct: DirectRoutes | None = None, other_connections: int = 0) -> None:
    """Run ``app`` (an ASGI app, or an import string with ``factory``) on uvicorn with uvloop and
    :class:`BoundedHttpToolsProtocol`; ``workers > 1`` needs an import string. ``log_config``: the
    logging document every process applies (kernel.logs), else uvicorn's own. ``proxy_headers``:
    uvicorn's ``ProxyHeadersMiddleware`` in front of ``app`` (it rewrites the ASGI scope's client
    address and scheme from ``X-Forwarded-For`` / ``X-Forwarded-Proto`` sent by a peer in
    ``FORWARDED_ALLOW_IPS``, loopback by default); off, the scope keeps the socket's peer, and no
    header a client sends changes it. ``direct``: the routes the protocol answers itself (the
    module's "Direct routes"), resolved from the loaded application in each worker.
    ``other_connections``: what else a process may hold open at its caps (the agent's gRPC port),
    for the file descriptor check (:func:`raise_fd_limit`)."""
    raise_fd_limit(limits.max_connections + other_connections + FDS_OF_ITS_OWN)
    extra: dict[str, Any] = {"log_config": log_config} if log_config is not None else {}
    config = LimitedConfig(app, host=host, port=port, loop="uvloop", http=BoundedHttpToolsProtocol, **extra,
                           log_level=log_level, access_log=access_log, lifespan="on", factory=factory,
                           workers=workers if workers > 1 else None, ssl_certfile=ssl_certfile,
                           ssl_keyfile=ssl_keyfile, limits=limits, proxy_headers=proxy_headers,
                           direct=direct, timeout_keep_alive=limits.keepalive_s)
    if workers > 1:
        from uvicorn.supervisors import Multiprocess

        sock: socket.socket = config.bind_socket()
        Multiprocess(config, sockets=[sock]).run()
    else:
        uvicorn.Server(config).run()


FDS_OF_ITS_OWN = 512  # a process's own: Redis and etcd pools, the allocator client, files, the listening sockets


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (inherited by worker
    processes), as the caps on open connections assume: a soft limit of 1,024 (a shell's or a
    container runtime's default) was reached before ``--http-max-connections``, and then the
    process could not open its own connections. A WARNING when the hard limit is below ``needed``
    (the caps can then not all be reached); returns the soft limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # a sandbox that refuses it
            log.warning("could not raise the open file limit from %d to %d: %s", soft, target, e)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("the open file limit (%d) is below what the connection caps need (%d): raise the "
                    "process's RLIMIT_NOFILE or lower --http-max-connections / --rls-max-connections", soft, needed)
    return soft


YOUNG_THRESHOLD = 5_000
"""The cyclic collector's young-generation threshold once a service has started (CPython's 700;
the middle and oldest generations' 10 and 10 are kept: they count collections of the generation
below, so they become as much rarer). A young collection runs when the container objects
allocated since the last one, less those freed, exceed it, and walks the survivors: at 700 an
agent under load walked its calls in flight every ~350 HTTP requests, and a full collection
every ~100 young ones walked all that had grown since start-up (up to 40 ms under HTTP load,
78 ms under RLS load); the collector took 1.6-2.0 us per HTTP request and 10-11.5 us per RLS
call. At 5,000: 0.02-0.2 and ~4 us, the agent's CPU per call about 3 % lower at both doors, no
pause longer than the default's longest. Larger values save little more and make each young
collection walk more survivors (50,000: 20-40 ms under figure 8's load). Measured in
``bench/README.md``; decision 0085."""


def freeze_startup_heap() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``),
    and raise the young generation's threshold to :data:`YOUNG_THRESHOLD`.
    Called once a service has started (its app, snapshot and connections built): what is alive
    then stays alive, and the cyclic collector's full collections no longer walk it. In an agent
    under figure 2's load a full collection walked the whole heap every ~5 s and held the event
    loop for 45-68 ms each time, a pause every connection's answer waited behind (``make bench``
    figure 2's p99). Frozen objects are still freed by reference counting; only a reference cycle
    among them is never collected (at most the start-up state replaced by a reload, once).
    Each worker process of ``--workers N`` calls it for itself."""
    import gc

    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def quiet_request_logs(level: str) -> None:
    """Per-request log lines of the HTTP clients (httpx logs every call at INFO: every lease
    request and usage report of an agent) only at debug; state changes stay at INFO."""
    if level.lower() != "debug":
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def on_termination(callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` first when SIGTERM or SIGINT arrives, then the handler installed before
    (uvicorn's, which starts its graceful shutdown). Main thread only; returns an undo function."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(sig: int, frame: Any) -> None:  # (a signal number: the key of ``previous``)
        try:
            callback()
        finally:
            prev = previous[signal.Signals(sig)]
            if callable(prev):
                prev(sig, frame)
            else:  # no Python handler before: restore the disposition and deliver the signal again
                signal.signal(sig, prev)
                signal.raise_signal(sig)

    for sig in previous:
        signal.signal(sig, handler)

    def undo() -> None:
        for sig, prev in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, prev)

    return undo
