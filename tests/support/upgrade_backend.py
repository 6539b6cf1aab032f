"""A backend that accepts every protocol upgrade: a request with ``Connection: upgrade`` and an
``Upgrade`` header is answered ``101 Switching Protocols``, and whatever the client then sends on
that connection is read as more HTTP requests and answered 200 — as a backend that speaks HTTP
inside its tunnel would (h2c, or a WebSocket endpoint in front of another HTTP server). A gateway
that lets such an upgrade through decides one request and then carries everything after it
undecided. :attr:`UpgradeBackend.seen` records each request it received: method, path, the
``Upgrade`` header it carried, and whether it came through a tunnel."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    tunnel = False  # per connection: set once this connection switched protocols

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        upgrade = self.headers.get("upgrade")
        wants = upgrade is not None and "upgrade" in (self.headers.get("connection") or "").lower()
        assert isinstance(self.server, _Server)
        self.server.seen.append({"method": self.command, "path": self.path, "upgrade": upgrade, "tunnelled": self.tunnel})
        if wants and not self.tunnel:
            self.send_response(101)
            self.send_header("connection", "upgrade")
            self.send_header("upgrade", upgrade or "")
            self.end_headers()
            self.tunnel = True
            return
        body = json.dumps({"upstream": "upgrade", "path": self.path, "tunnelled": self.tunnel}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


class _Server(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict] = []


class UpgradeBackend:
    """The backend on ``127.0.0.1:<port>`` in a thread of the test process; :meth:`stop` ends it."""

    def __init__(self) -> None:
        self.server = _Server()
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="upgrade-backend", daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[dict]:
        return self.server.seen

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


__all__ = ["UpgradeBackend"]
