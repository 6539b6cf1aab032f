"""The agent's HTTP keep-alive (``--http-keepalive-s``) on a real agent process: a connection left
idle between requests for longer than uvicorn's own 5 s is still served, as a gateway's pooled
connection is (docs/gateways.md, "Idle connections"); one idle past the setting is closed by the
agent."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.agent import agent_process

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n"


def answer(sock: socket.socket) -> bytes:
    """One whole answer (head and its Content-Length body) read from ``sock``; b"" when the agent
    closed the connection before answering."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65_536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65_536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def connect(base: str) -> socket.socket:
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def ask(sock: socket.socket) -> bytes:
    try:
        sock.sendall(REQUEST)
        return answer(sock)
    except (ConnectionResetError, BrokenPipeError):
        return b""


def test_a_connection_idle_longer_than_uvicorns_default_is_still_served(redis_url: str, policy_file: Path,
                                                                         tmp_path: Path):
    with agent_process(tmp_path / "agent", redis_url, policy_file) as (base, _proc), connect(base) as sock:
        assert ask(sock).startswith(b"HTTP/1.1 200 "), "the first request"
        time.sleep(6.0)  # longer than uvicorn's default keep-alive (5 s), shorter than the agent's
        second = ask(sock)
        assert second.startswith(b"HTTP/1.1 200 "), f"the same connection after 6 s idle: {second!r}"


def test_a_connection_idle_past_the_setting_is_closed(redis_url: str, policy_file: Path, tmp_path: Path):
    with agent_process(tmp_path / "agent", redis_url, policy_file, "--http-keepalive-s", "1") as (base, _proc), \
            connect(base) as sock:
        assert ask(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        assert sock.recv(1) == b""  # the agent closes the idle connection (recv waits up to 10 s)
        assert 0.8 <= time.monotonic() - started < 5.0
