"""A backend that reads request headers the way CGI-style servers do (RFC 3875 meta-variables:
WSGI servers, PHP through FastCGI, Rack): each header becomes ``HTTP_`` + its name upper-cased
with every ``-`` replaced by ``_``, and headers that end up with the same name are joined with
``,`` in the order they arrived (as ``wsgiref`` joins them). So ``x_tenant_id`` and
``x-tenant-id`` are one variable to it, ``HTTP_X_TENANT_ID``: what a client sends under the
first name is read as the second. Every request is answered 200 with JSON
``{"upstream": "cgi", "path": ..., "environ": {HTTP_...: value}}``, for a gateway in front of it."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from typing import Any

from .http_backend import JsonHandler, ThreadedBackend


def meta_variables(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The ``HTTP_*`` variables of ``headers`` (name, value), in arrival order."""
    out: dict[str, str] = {}
    for name, value in headers:
        key = "HTTP_" + name.upper().replace("-", "_")
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


class _Handler(JsonHandler):
    def answer(self) -> dict[str, Any]:
        return {"upstream": "cgi", "path": self.path, "environ": meta_variables(list(self.headers.items()))}


class CgiBackend(ThreadedBackend):
    """The backend on ``127.0.0.1:<port>`` in a thread of the test process; :meth:`stop` ends it."""

    def __init__(self) -> None:
        super().__init__(ThreadingHTTPServer(("127.0.0.1", 0), _Handler), "cgi-backend")


__all__ = ["CgiBackend", "meta_variables"]
