"""A recording stand-in for an asyncio transport, for driving an HTTP protocol (uvicorn's, with
kernel.httpserver's subclass) without a socket: every write is kept, and a write after the close
is kept apart (``late``) so a test can assert there was none."""

from __future__ import annotations

from typing import Any


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.late: list[bytes] = []  # written after close
        self.closed = False

    @property
    def data(self) -> bytes:
        return b"".join(self.writes)

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        if self.closed:
            self.late.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...
