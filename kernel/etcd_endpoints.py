"""etcd endpoint lists as operators write them (``host:port``, ``http://host:port``,
``https://host:port``, comma-separated) — pure parsing, shared by the etcd adapter, the settings
checks and the CLI. The scheme is kept, not stripped: ``https://`` means TLS
(:mod:`kernel.etcd_tls`)."""

from __future__ import annotations

from collections.abc import Sequence

SCHEMES = ("http", "https")


def _items(endpoints: str | Sequence[str]) -> list[str]:
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    return [i.strip() for i in items if i.strip()]


def _split(item: str) -> tuple[str | None, str, int]:
    scheme = None
    if "://" in item:
        scheme, item = item.split("://", 1)
        if scheme not in SCHEMES:
            raise ValueError(f"etcd endpoint {scheme}://{item} must use http:// or https:// (or no scheme)")
    host, sep, port = item.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"etcd endpoint {item!r} must be host:port, http://host:port or https://host:port")
    return scheme, host, int(port)


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """``(host, port)`` of each endpoint; ``ValueError`` naming a malformed one, a scheme other
    than http/https, a mix of http:// and https://, or an empty list."""
    out = [_split(i)[1:] for i in _items(endpoints)]
    if not out:
        raise ValueError("at least one etcd endpoint is needed")
    endpoints_scheme(endpoints)
    return out


def endpoints_scheme(endpoints: str | Sequence[str]) -> str | None:
    """``"https"``, ``"http"`` or ``None`` (no endpoint names a scheme); a mix is a ``ValueError``."""
    schemes = {_split(i)[0] for i in _items(endpoints)} - {None}
    if len(schemes) > 1:
        raise ValueError("etcd endpoints mix http:// and https://: one cluster speaks either TLS or plaintext")
    return schemes.pop() if schemes else None
