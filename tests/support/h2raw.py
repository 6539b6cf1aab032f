"""A hand-written HTTP/2 client for gRPC doors, enough to misbehave as grpcio never does: streams
opened and never given their message, calls whose answers are never taken (an initial window of
0), a connection that is never read. Frames are written as RFC 9113 lays them out; header blocks
are HPACK literals without indexing (no table, no Huffman), which every server must accept."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 0x3, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _int(n: int, bits: int) -> bytes:
    top = (1 << bits) - 1
    if n < top:
        return bytes((n,))
    out, n = bytearray((top,)), n - top
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    out = b""
    for k, v in headers:
        kb, vb = k.encode(), v.encode()
        out += b"\x00" + _int(len(kb), 7) + kb + _int(len(vb), 7) + vb
    return out


def grpc_call_headers(path: str, token: str | None = None) -> bytes:
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "agent"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    if token is not None:
        headers.append(("authorization", f"Bearer {token}"))
    return header_block(headers)


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(body)) + body


Frame = tuple[int, int, int, bytes]  # (type, flags, stream id, payload)


def _has_settings(frames: list[Frame]) -> bool:
    return any(kind == SETTINGS and not flags & ACK for kind, flags, _, _ in frames)


class RawConnection:
    """One HTTP/2 connection to ``port`` on loopback. ``window``: the initial stream window it
    announces (0: the server may send no answer's message on any stream)."""

    def __init__(self, port: int, *, window: int | None = None, recv_buffer: int | None = None):
        self.sock = socket.socket()
        if recv_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(10)
        settings = b"" if window is None else struct.pack(">HI", INITIAL_WINDOW_SIZE, window)
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
        self.next_stream = 1

    def open(self, n: int, path: str, *, token: str | None = None, message: bytes | None = None,
             end: bool = False) -> None:
        """``n`` new streams calling ``path``: with ``message`` sent and the stream half-closed;
        without, headers only (``end``: half-closed at once, a call with no message at all)."""
        head = grpc_call_headers(path, token)
        out = []
        for _ in range(n):
            sid, self.next_stream = self.next_stream, self.next_stream + 2
            if message is None:
                out.append(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, head))
            else:
                out.append(frame(HEADERS, END_HEADERS, sid, head) + frame(DATA, END_STREAM, sid, grpc_message(message)))
        self.sock.sendall(b"".join(out))

    def frames(self, within_s: float, until: Callable[[list[Frame]], bool] | None = None) -> list[Frame]:
        """The frames the server sends within ``within_s`` (until it closes the connection, or as
        soon as ``until`` holds for the frames read so far)."""
        out: list[Frame] = []
        buf = b""
        deadline = time.monotonic() + within_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65_536)
            except (TimeoutError, ConnectionError):
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                out.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFF_FFFF, buf[9:9 + n]))
                buf = buf[9 + n:]
            if until is not None and until(out):
                break
        return out

    def settings(self, within_s: float = 10.0) -> dict[int, int]:
        """The server's first SETTINGS (read at the connection's start), acknowledged as every
        client does (grpc closes a connection whose peer acknowledges none: ``settings_timeout``).
        Returned as soon as they come: ``within_s`` only bounds a server that sends none and
        keeps the connection open (one that refuses the connection closes it, which ends the wait)."""
        for kind, flags, _, payload in self.frames(within_s, until=_has_settings):
            if kind == SETTINGS and not flags & ACK:
                self.sock.sendall(frame(SETTINGS, ACK, 0))
                return {struct.unpack(">H", payload[i:i + 2])[0]: struct.unpack(">I", payload[i + 2:i + 6])[0]
                        for i in range(0, len(payload), 6)}
        raise AssertionError("no SETTINGS from the server")

    def close(self) -> None:
        self.sock.close()


__all__ = ["RawConnection", "frame", "grpc_call_headers", "grpc_message", "header_block"]
