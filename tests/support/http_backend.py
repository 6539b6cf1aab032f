"""What the test backends in this package share: a handler that answers every method with JSON
(the request's body read and dropped, nothing logged) and a server on ``127.0.0.1:<port>`` in a
thread of the test process. A backend subclasses :class:`JsonHandler` (its :meth:`~JsonHandler.answer`)
and :class:`ThreadedBackend`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self) -> dict[str, Any] | None:
        """The JSON object to answer 200 with; None when the subclass answered itself."""
        raise NotImplementedError

    def _handle(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        obj = self.answer()
        if obj is None:
            return
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


class ThreadedBackend:
    """``server`` (a ThreadingHTTPServer on 127.0.0.1, any free port) served in a daemon thread;
    :meth:`stop` ends it."""

    def __init__(self, server: ThreadingHTTPServer, name: str) -> None:
        self.server = server
        self.port = server.server_address[1]
        self.thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


__all__ = ["JsonHandler", "ThreadedBackend"]
