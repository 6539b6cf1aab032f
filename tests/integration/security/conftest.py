"""Both services as real processes for the hostile-input tests of this package (schema fuzzing,
the hostile-body corpus, header and slow-client limits): started once per package, with
authentication on, real Redis and real etcd, short HTTP head/body deadlines so the slow-client
tests stay short."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernel.bundle import Pool
from leasehold.local.procs import Proc, RedisServer, free_port, wait_port
from leasehold.local.services import agent_command, allocator_command
from tests.support.allocator_app import unique_prefix
from tests.support.policies import NORTHSTAR, ROOT, write_pools

TOKEN = secrets.token_urlsafe(24)
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
HEAD_TIMEOUT_MS = 1_000  # --http-header-timeout-ms / --http-body-timeout-ms of both processes
BODY_TIMEOUT_MS = 1_000
WRITE_TIMEOUT_MS = 1_000  # --http-write-timeout-ms: a client that reads none of its answers
MAX_HEADER_BYTES = 16_384  # the defaults, passed explicitly so the tests state what they check
MAX_HEADERS = 100
WAIT_S = 15.0  # bound on every wait for the server to act (it acts after HEAD/BODY_TIMEOUT_MS = 1 s)
HTTP_ARGS = ("--http-header-timeout-ms", str(HEAD_TIMEOUT_MS), "--http-body-timeout-ms", str(BODY_TIMEOUT_MS),
             "--http-write-timeout-ms", str(WRITE_TIMEOUT_MS),
             "--http-max-header-bytes", str(MAX_HEADER_BYTES), "--http-max-headers", str(MAX_HEADERS))


@dataclass
class Service:
    name: str
    base: str
    port: int
    proc: Proc
    post_routes: dict[str, dict]  # path -> a valid body
    redis: RedisServer | None = None  # the agent's Redis

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}

    def log(self) -> str:
        assert self.proc.log_path is not None
        return self.proc.log_path.read_text(errors="replace")


def _wait_ready(base: str, proc: Proc) -> None:
    for _ in range(600):
        assert proc.alive(), proc.tail()
        with contextlib.suppress(httpx.HTTPError):
            if all(httpx.get(base + p, timeout=2).status_code == 200 for p in ("/readyz", "/v1/health/store")):
                return  # ready, and its store healthy (the allocator knows its role)
        time.sleep(0.05)
    raise AssertionError(f"{proc.name} not ready:\n{proc.tail()}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")}
    env.update(PYTHONPATH=str(ROOT), LEASEHOLD_AGENT_PEPPER="fuzz-pepper-not-secret")
    return env


def _admit(rid: str) -> dict:
    return {"requestId": rid, "tenantId": "atlas", "principal": {"type": "user", "id": "U-17", "apiKeyId": "K1"},
            "routeGroup": "read", "method": "GET", "costHint": 1}


@pytest.fixture(scope="package")
def agent_service(tmp_path_factory) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("hostile-agent")
    redis_srv = RedisServer(work / "redis").start()
    port = free_port()
    proc = Proc(f"hostile-agent-{port}", agent_command(
        *HTTP_ARGS, redis_url=redis_srv.url, policy=NORTHSTAR, region="eu", host="127.0.0.1", port=port,
        policy_poll_ms=0, auth_disabled=False, gateway_tokens=[f"fuzz:{DIGEST}"], operator_tokens=[f"ops:{DIGEST}"],
        log_level="info"), work / "agent", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        release = {"requestId": "hostile-000001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
                   "routeGroup": "export"}
        yield Service("agent", base, port, proc, {
            "/v1/admit": _admit("hostile-000001"), "/v1/admit/batch": {"requests": [_admit("hostile-000002")]},
            "/v1/release": release, "/v1/renew": release}, redis=redis_srv)
    finally:
        proc.stop()
        redis_srv.stop()


@pytest.fixture(scope="package")
def allocator_service(tmp_path_factory, etcd_cluster) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("hostile-allocator")
    bundle = write_pools(work / "pools.json", [Pool(id="p1", window_ms=60_000, limit=1_000_000, chunk_max=1000),
                                               Pool(id="p2", window_ms=1_000, limit=50, chunk_max=10, prefetch_ms=100)])
    port = free_port()
    proc = Proc(f"hostile-allocator-{port}", allocator_command(
        *HTTP_ARGS, etcd=etcd_cluster.endpoints, policy=bundle, node_id="fuzz-1", host="127.0.0.1", port=port,
        prefix=unique_prefix(), auth_disabled=False, region_tokens=[f"eu:{DIGEST}"], log_level="info"),
        work / "allocator", env=_env()).start()
    try:
        wait_port(port, proc=proc.popen, timeout=30)
        base = f"http://127.0.0.1:{port}"
        _wait_ready(base, proc)
        lease = {"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1", "want": 1}
        yield Service("allocator", base, port, proc, {
            "/v1/leases": lease, "/v1/leases/batch": {"requests": [{**lease, "leaseId": "hostile-lease-0002"}]},
            "/v1/leases/hostile-lease-0001/usage": {"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1",
                                                    "spent": 0},
            "/v1/usage/batch": {"reports": [{"leaseId": "hostile-lease-0001", "region": "eu", "pool": "p1",
                                             "spent": 0}]}})
    finally:
        proc.stop()


@pytest.fixture(params=["agent", "allocator"])
def service(request) -> Service:
    return request.getfixturevalue(f"{request.param}_service")


def rss_kib(pid: int) -> int:
    """Resident set size of a process (and its children, e.g. uvicorn workers), from /proc."""
    total = 0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for t in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(c) for c in (t / "children").read_text().split()]
    return out


# ---------------------------------------------------------------------------- raw HTTP on loopback


def connect(svc: Service) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=WAIT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_answer(s: socket.socket, within_s: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection (bounded in time)."""
    s.settimeout(within_s)
    out = b""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:  # closed while our own bytes were still arriving
            return out
        except TimeoutError:
            break
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"connection not closed by the server within {within_s} s; got {out[:200]!r}")


def assert_problem(answer: bytes, status: int) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    assert b"content-type: application/problem+json" in head.lower(), head
    assert json.loads(body)["status"] == status


@dataclass
class Answer:
    """One HTTP/1.1 answer as it came off the wire (``raw``), split by its own framing."""

    status: int
    headers: list[tuple[str, str]]  # in order, names lower-cased
    body: bytes
    raw: bytes
    interim: list[bytes] = field(default_factory=list)  # 1xx answers that came before it

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n == name]
        assert len(values) <= 1, f"{name} repeated: {self.raw[:400]!r}"
        return values[0] if values else None

    @property
    def content_type(self) -> str:
        return self.header("content-type") or ""

    @property
    def closes(self) -> bool:
        return "close" in (self.header("connection") or "").lower()

    def json(self) -> Any:
        return json.loads(self.body)


class Wire:
    """A raw client connection that reads answers one at a time, each framed by its own
    Content-Length (or chunked coding), so pipelined answers are told apart byte-exactly: an
    answer cut short, two answers run together or bytes that are no answer fail the read."""

    def __init__(self, svc: Service) -> None:
        self.sock = connect(svc)
        self.buf = b""
        self.eof = False

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, deadline: float) -> bool:
        """Read more bytes; False once the server closed the connection."""
        if self.eof:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no complete answer in time; buffered {self.buf[:400]!r}")
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"no complete answer within {WAIT_S} s; buffered {self.buf[:400]!r}") from None
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            if not self._fill(deadline):
                raise AssertionError(f"closed after {len(self.buf)} of {n} bytes: {self.buf[:400]!r}")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self, deadline: float) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill(deadline):
                raise AssertionError(f"closed in the middle of a line: {self.buf[:400]!r}")
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def answer(self, within_s: float = WAIT_S) -> Answer:
        """The next answer (1xx interim answers before it are kept in ``interim``)."""
        deadline = time.monotonic() + within_s
        interim: list[bytes] = []
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self._fill(deadline):
                    raise AssertionError(f"closed before an answer's head was complete: {self.buf[:400]!r}")
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status_line = lines[0]
            assert status_line[:9] == b"HTTP/1.1 " and status_line[9:12].isdigit() and status_line[12:13] == b" ", \
                f"not an answer's status line: {head[:400]!r}"
            status = int(status_line[9:12])
            headers = []
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                assert sep and name and name == name.strip(), f"bad header line {line!r} in {head[:400]!r}"
                headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
            if 100 <= status < 200:
                interim.append(head)
                continue
            break
        lengths = [v for n, v in headers if n == "content-length"]
        codings = [v.lower() for n, v in headers if n == "transfer-encoding"]
        raw = head + b"\r\n\r\n"
        if codings:
            assert codings == ["chunked"] and not lengths, f"answer framing: {head[:400]!r}"
            body = b""
            while True:
                size_line = self._line(deadline)
                raw += size_line + b"\r\n"
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    assert self._line(deadline) == b"", "trailers in an answer"
                    raw += b"\r\n"
                    break
                chunk = self._take(size + 2, deadline)
                assert chunk.endswith(b"\r\n")
                raw += chunk
                body += chunk[:-2]
        else:
            assert len(lengths) == 1 and lengths[0].isdigit(), f"answer framing: {head[:400]!r}"
            body = self._take(int(lengths[0]), deadline)
            raw += body
        return Answer(status, headers, body, raw, interim)

    def answer_or_close(self, within_s: float = WAIT_S) -> Answer | None:
        """The next answer, or None when the server closes the connection before sending one."""
        deadline = time.monotonic() + within_s
        while not self.buf:
            if not self._fill(deadline):
                return None
        return self.answer(max(0.0, deadline - time.monotonic()))

    def closed(self, within_s: float = WAIT_S) -> bool:
        """After the answers expected: True once the server has closed the connection without
        sending anything more (an AssertionError if it sends more bytes, or stays open)."""
        deadline = time.monotonic() + within_s
        while self._fill(deadline):
            pass
        assert not self.buf, f"bytes after the last answer: {self.buf[:400]!r}"
        return True

    def silent(self, for_s: float) -> None:
        """Nothing more arrives for ``for_s`` seconds (the connection may stay open or close)."""
        self.sock.settimeout(for_s)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            chunk = b""
        except ConnectionResetError:
            chunk = b""
        assert not self.buf and not chunk, f"unexpected bytes: {(self.buf + chunk)[:400]!r}"
