"""kernel.asgi: a fast path reads a body up to a limit and can hand the request on with the body
replayed."""

from __future__ import annotations

from kernel.asgi import read_body, replay


def receiver(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


async def test_a_body_in_chunks_is_joined():
    chunks, body = await read_body(receiver({"type": "http.request", "body": b"ab", "more_body": True},
                                            {"type": "http.request", "body": b"cd"}), max_body=10)
    assert body == b"abcd" and len(chunks) == 2


async def test_a_body_over_the_limit_or_a_disconnect_is_none_and_replayed_whole():
    live = receiver({"type": "http.request", "body": b"12345", "more_body": True},
                    {"type": "http.request", "body": b"67890"}, {"type": "http.disconnect"})
    chunks, body = await read_body(live, max_body=8)
    assert body is None and len(chunks) == 2  # stopped reading at the limit
    again = replay(chunks, live)
    assert [(await again())["body"], (await again())["body"], (await again())["type"]] == [
        b"12345", b"67890", "http.disconnect"]  # the read messages, then the live ones
    gone, body = await read_body(receiver({"type": "http.disconnect"}), max_body=8)
    assert body is None and gone == [{"type": "http.disconnect"}]
