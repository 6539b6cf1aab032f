"""What both services' ASGI fast paths share: reading a request body up to a limit while keeping
the messages read, so a request the fast path does not serve is handed to the framework with its
body replayed (``replay``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Message = dict[str, Any]  # an ASGI message


async def read_body(receive: Callable[[], Awaitable[Message]], max_body: int) -> tuple[list[Message], bytes | None]:
    """``(messages read, body)``: ``body`` is None when the body is over ``max_body`` bytes or the
    client went away (the messages are then replayed to the framework, which answers)."""
    chunks: list[Message] = []
    size = 0
    while True:
        msg = await receive()
        chunks.append(msg)
        if msg["type"] != "http.request":
            break
        size += len(msg.get("body", b""))
        if size > max_body or not msg.get("more_body", False):
            break
    last = chunks[-1]
    if size <= max_body and last["type"] == "http.request" and not last.get("more_body", False):
        return chunks, b"".join(m.get("body", b"") for m in chunks)
    return chunks, None


def replay(chunks: list[Message], receive: Callable[[], Awaitable[Message]]) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that yields the messages already read, then the live ones."""
    pending = list(chunks)

    async def again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return again
