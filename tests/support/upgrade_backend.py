"""A backend that accepts every protocol upgrade: a request with ``Connection: upgrade`` and an
``Upgrade`` header is answered ``101 Switching Protocols``, and whatever the client then sends on
that connection is read as more HTTP requests and answered 200 — as a backend that speaks HTTP
inside its tunnel would (h2c, or a WebSocket endpoint in front of another HTTP server). A gateway
that lets such an upgrade through decides one request and then carries everything after it
undecided. :attr:`UpgradeBackend.seen` records each request it received: method, path, the
``Upgrade`` header it carried, and whether it came through a tunnel."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from typing import Any

from .http_backend import JsonHandler, ThreadedBackend


class _Handler(JsonHandler):
    tunnel = False  # per connection: set once this connection switched protocols

    def answer(self) -> dict[str, Any] | None:
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
            return None
        return {"upstream": "upgrade", "path": self.path, "tunnelled": self.tunnel}


class _Server(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict] = []


class UpgradeBackend(ThreadedBackend):
    """The backend on ``127.0.0.1:<port>`` in a thread of the test process; :meth:`stop` ends it."""

    def __init__(self) -> None:
        super().__init__(_Server(), "upgrade-backend")

    @property
    def seen(self) -> list[dict]:
        assert isinstance(self.server, _Server)
        return self.server.seen


__all__ = ["UpgradeBackend"]
