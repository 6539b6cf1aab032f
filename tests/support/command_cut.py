"""A TCP proxy (its own thread and event loop, so it forwards while the test's loop or an app's
startup waits) between a client and a real redis-server that cuts the connection a given command
arrives on: armed with the command's RESP bytes, the first connection
whose client-to-server stream carries them is aborted on both sides before they are forwarded —
the server never sees the command, the client loses its connection while it awaits the reply.
One cut per arming; every other byte is forwarded as it came."""

from __future__ import annotations

import asyncio
import contextlib
import threading


def resp_command(*words: str) -> bytes:
    """The RESP bytes a client sends for a command's first words (``SCRIPT``, ``LOAD``)."""
    return b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in words)


class CommandCut:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.host, self.upstream_port = host, upstream_port
        self.port = 0
        self.cuts = 0  # connections cut so far
        self._needle: bytes | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    def arm(self, needle: bytes) -> None:
        """Cut the next connection that sends ``needle`` (see :func:`resp_command`)."""
        self._needle = needle

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def __enter__(self) -> CommandCut:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="command-cut", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._on_client, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._conns):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _on_client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            c_writer.transport.abort()
            return
        pair = (c_writer, s_writer)
        self._conns.update(pair)
        up = asyncio.ensure_future(self._pump(c_reader, s_writer, pair, watch=True))
        down = asyncio.ensure_future(self._pump(s_reader, c_writer, pair, watch=False))
        self._tasks.update((up, down))
        try:
            await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in pair:
                w.transport.abort()
                self._conns.discard(w)
            for t in (up, down):
                t.cancel()
                self._tasks.discard(t)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, ...], *, watch: bool) -> None:
        tail = b""
        while True:
            chunk = await src.read(65_536)
            if not chunk:
                return
            needle = self._needle
            if watch and needle is not None and needle in tail + chunk:
                self._needle = None
                self.cuts += 1
                for w in pair:  # neither side gets another byte of this connection
                    w.transport.abort()
                return
            if watch and needle is not None:
                tail = (tail + chunk)[-(len(needle) - 1):]
            dst.write(chunk)
            await dst.drain()
