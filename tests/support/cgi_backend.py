"""A backend that reads request headers the way CGI-style servers do (RFC 3875 meta-variables:
WSGI servers, PHP through FastCGI, Rack): each header becomes ``HTTP_`` + its name upper-cased
with every ``-`` replaced by ``_``, and headers that end up with the same name are joined with
``,`` in the order they arrived (as ``wsgiref`` joins them). So ``x_tenant_id`` and
``x-tenant-id`` are one variable to it, ``HTTP_X_TENANT_ID``: what a client sends under the
first name is read as the second. Every request is answered 200 with JSON
``{"upstream": "cgi", "path": ..., "environ": {HTTP_...: value}}``, for a gateway in front of it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def meta_variables(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The ``HTTP_*`` variables of ``headers`` (name, value), in arrival order."""
    out: dict[str, str] = {}
    for name, value in headers:
        key = "HTTP_" + name.upper().replace("-", "_")
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"upstream": "cgi", "path": self.path,
                           "environ": meta_variables(list(self.headers.items()))}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


class CgiBackend:
    """The backend on ``127.0.0.1:<port>`` in a thread of the test process; :meth:`stop` ends it."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="cgi-backend", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


__all__ = ["CgiBackend", "meta_variables"]
