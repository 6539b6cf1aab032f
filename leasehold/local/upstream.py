"""A tiny demo upstream for the gateways in front of it (``make run``, e2e tests, the
benchmark): HTTP/1.1 keep-alive, answers every request ``200`` with a small JSON body that
names the upstream, the method, the path and the identity, limiter and trace headers it was sent
(``ECHOED``: what the backend behind a gateway sees; a header sent twice, joined with ","). ``python -m leasehold.local.upstream --port N``.

asyncio + uvloop + httptools (already dependencies of the agent), so that in the benchmark
the upstream is never what limits Envoy."""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools

from .procs import LOOPBACK

_CLOSE = "connection: close\r\n"
# the request headers the answer echoes (lower case): identity, request id, limiter inputs, Leasehold's
# control headers, trace context
ECHOED = frozenset({b"x-request-id", b"x-tenant-id", b"x-user-id", b"x-api-key-id", b"x-service-id",
                    b"x-route-group", b"x-forwarded-for", b"x-real-ip", b"x-leasehold-auth-failed",
                    b"x-leasehold-cost", b"x-leasehold-authorization", b"x-leasehold-deny-status",
                    b"x-leasehold-status", b"authorization", b"traceparent", b"tracestate"})


class _Conn(asyncio.Protocol):
    def __init__(self, name: str):
        self.name = name
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.seen: dict[str, str] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        low = name.lower()
        if low in ECHOED:  # a header sent more than once: every value, joined as one field
            key, text = low.decode(), value.decode("latin-1")
            self.seen[key] = f"{self.seen[key]},{text}" if key in self.seen else text

    def on_message_complete(self) -> None:
        body = json.dumps({"upstream": self.name, "method": self.parser.get_method().decode(),
                           "path": self.url.decode("latin-1"), "headers": self.seen}).encode()
        self.url = b""
        self.seen = {}
        keep = self.parser.should_keep_alive()
        head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"{'' if keep else _CLOSE}\r\n").encode()
        assert self.transport is not None
        self.transport.write(head + body)
        if not keep:
            self.transport.close()


async def serve(host: str, port: int, name: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(name), host, port, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m leasehold.local.upstream", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="upstream")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(a.host, a.port, a.name))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
