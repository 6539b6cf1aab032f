"""HTTP-level hostile clients against both services as real processes on loopback (docs/security.md): huge and numerous headers before authentication, slow heads, slow bodies, idle
connections, a large Content-Length with no body and a client that never reads its answers. Limits are checked by behaviour: the
connection is answered 431/408/413 (problem+json) and closed, the RSS of the process stays within
a stated budget, and ``/healthz`` keeps answering while the attack runs."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import (
    BODY_TIMEOUT_MS,
    HEAD_TIMEOUT_MS,
    MAX_HEADER_BYTES,
    MAX_HEADERS,
    WAIT_S,
    WRITE_TIMEOUT_MS,
    Service,
    assert_problem,
    connect,
    read_answer,
    rss_kib,
)

pytestmark = pytest.mark.integration

RSS_BUDGET_KIB = 24 * 1024  # what an attack below may add to the process's resident memory


@contextlib.contextmanager
def health_probe(svc: Service) -> Iterator[list[int]]:
    """Polls /healthz during the block; yields the list of answers (status, or 0 for a failure)."""
    stop = threading.Event()
    answers: list[int] = []

    first = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=3.0) as c:
            while True:  # at least one probe, and one more after the block (a fast block had none)
                try:
                    answers.append(c.get(svc.base + "/healthz").status_code)
                except httpx.HTTPError:
                    answers.append(0)
                first.set()
                if stop.wait(0.05):
                    break

    t = threading.Thread(target=run, daemon=True)
    t.start()
    first.wait(10)  # the probe is running before the block starts
    try:
        yield answers
    finally:
        stop.set()
        t.join(10)


def stream_header(svc: Service, total: int, results: list[bytes]) -> None:
    """One request whose single header value is ``total`` bytes, sent as fast as the server reads."""
    s = connect(svc)
    try:
        s.sendall(b"POST /v1/admit HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-pad: ")
        chunk = b"a" * (1 << 20)
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, socket.timeout):
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
        results.append(read_answer(s))
    finally:
        s.close()


def test_huge_headers_are_refused_and_memory_stays_bounded(service: Service):
    before = rss_kib(service.proc.pid)
    results: list[bytes] = []
    with health_probe(service) as health:
        stream_header(service, 256 << 20, results)  # one 256 MiB header
        threads = [threading.Thread(target=stream_header, args=(service, 16 << 20, results)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        time.sleep(0.2)
    assert len(results) == 11
    for answer in results:
        assert_problem(answer, 431)
    grown = rss_kib(service.proc.pid) - before
    assert grown <= RSS_BUDGET_KIB, f"RSS grew by {grown} KiB (budget {RSS_BUDGET_KIB} KiB)"
    assert health and all(code == 200 for code in health), health


def test_too_many_or_too_long_headers_are_refused(service: Service):
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    long = b"x-long: " + b"b" * MAX_HEADER_BYTES + b"\r\n"
    for extra in (many, long):
        s = connect(service)
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
            assert_problem(read_answer(s), 431)
        finally:
            s.close()
    # within the limits: served
    s = connect(service)
    try:
        fine = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS - 2))
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + fine + b"\r\n")
        assert read_answer(s).startswith(b"HTTP/1.1 200 ")
    finally:
        s.close()


def test_slow_and_idle_connections_are_closed(service: Service):
    """50 connections trickling a head, 10 opening and sending nothing, 10 sending a head and part of
    the body: each is answered 408 (the first and last) or closed, while /healthz keeps answering."""
    slow_head = [connect(service) for _ in range(50)]
    idle = [connect(service) for _ in range(10)]
    slow_body = [connect(service) for _ in range(10)]
    try:
        for s in slow_head:
            s.sendall(b"POST /v1/admit HTTP/1.1\r\nhost: x\r\n")
        path = next(iter(service.post_routes)).encode()
        auth = service.headers["Authorization"].encode()
        for s in slow_body:  # an authenticated request whose body stops after a few bytes
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"authorization: " + auth + b"\r\ncontent-length: 100\r\n\r\n{\"requestId\"")
        started = time.monotonic()
        with health_probe(service) as health:
            # keep trickling until the server closes the slow-head connections (bounded)
            open_ = list(slow_head)
            while open_ and time.monotonic() - started < WAIT_S:
                for s in list(open_):
                    try:
                        s.sendall(b"x")
                    except OSError:
                        open_.remove(s)
                time.sleep(0.2)
        assert not open_, f"{len(open_)} slow-head connections still open after {WAIT_S} s"
        for s in slow_head:
            answer = read_answer(s)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        for s in idle:
            assert read_answer(s) == b""  # nothing was asked: closed without an answer
        for s in slow_body:
            assert_problem(read_answer(s), 408)
        assert health and all(code == 200 for code in health), health
        assert HEAD_TIMEOUT_MS <= 1_000 and BODY_TIMEOUT_MS <= 1_000  # what made the waits above short
    finally:
        for s in (*slow_head, *idle, *slow_body):
            s.close()


def test_slow_head_gets_408(service: Service):
    s = connect(service)
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # never finished
        assert_problem(read_answer(s), 408)
    finally:
        s.close()


def test_a_client_that_never_reads_its_answers_is_cut_off(service: Service):
    """A client pipelines ``GET /metrics`` (a large answer) and reads nothing: once its answers fill
    the socket buffers the server stops reading its requests (backpressure) and, its answers not
    taken within --http-write-timeout-ms, resets the connection instead of holding it (and the
    task waiting to write its answer) for as long as the client keeps the socket open. Every other
    deadline sleeps while an answer waits to be written: before the write deadline such a
    connection was still open after minutes. /healthz keeps answering meanwhile."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's kernel keeps little for it
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    s.connect(("127.0.0.1", service.port))
    request = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"
    logged = len(service.log())
    try:
        with health_probe(service) as health:
            s.settimeout(0.2)
            started = time.monotonic()
            blocked = False  # the server stopped reading: backpressure reached the client
            reset = None
            while reset is None and time.monotonic() - started < WAIT_S:
                try:
                    s.sendall(request * 16)  # blocks (times out) while the connection is held
                except TimeoutError:
                    blocked = True
                except (ConnectionResetError, BrokenPipeError):
                    reset = time.monotonic() - started
            assert reset is not None, (
                f"a client that read none of its answers still held its connection after {WAIT_S} s "
                f"(the server stopped reading it: {blocked})")
        assert reset >= WRITE_TIMEOUT_MS / 1000, reset  # not before its answers waited that long
        assert health and all(code == 200 for code in health), health
        # the answer that was waiting to be written ends quietly (no write on the closed transport)
        assert "Traceback" not in service.log()[logged:], service.log()[logged:][-3000:]
    finally:
        s.close()


def test_upgrade_requests_cannot_flood_the_log(service: Service):
    """Neither service serves a protocol upgrade. uvicorn wrote two WARNING lines for every request
    carrying ``Connection: Upgrade`` (one telling the operator to install a WebSocket library), so an
    unauthenticated client wrote two log lines per 70-byte request. The request is served as plain
    HTTP and the upgrade noted at most once a second."""
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n"
    logged = len(service.log().splitlines())
    s = connect(service)
    try:
        for _ in range(200):
            s.sendall(request)
            answer = b""
            while b'{"status":"ok"}' not in answer:
                chunk = s.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    finally:
        s.close()
    new = service.log().splitlines()[logged:]
    assert len(new) <= 10, "\n".join(new[:10])
    assert not any("pip install" in line for line in new), new[:4]
