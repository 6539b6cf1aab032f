"""Bearer-token authentication shared by both services.

Tokens are stored only as ``sha256`` hex digests (settings, env or a file); a presented token
is hashed and compared with every stored digest in constant time. A missing, malformed,
unknown or wrong token — or more than one Authorization header — gets the same 401 problem (no
hint which it was), with ``WWW-Authenticate: Bearer realm="leasehold"``.

Allocator: one token per region; :class:`RegionAuth` is what ``region_auth_guard`` calls.
It records the authenticated region on the request scope; the lease routes then refuse
(403, before anything is written) a body or a lease naming another region.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .config import ConfigError
from .errors import Forbidden, Unauthorized

SCOPE_KEY = "leasehold.principal"  # where the authenticated name is kept on the ASGI scope
HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
ENTRY = re.compile(r"^(?:([A-Za-z0-9._-]{1,64})\s*[:= ]\s*)?(?:sha256:)?([0-9a-fA-F]{64})\Z")
BEARER = re.compile(r"^Bearer ([\x21-\x7e]{1,512})\Z")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """name -> sha256 digests; ``who(token)`` is the name whose digest matches, or None."""

    def __init__(self, entries: Iterable[tuple[str, str]] = ()):
        self._entries: list[tuple[bytes, str]] = []
        for name, digest in entries:
            self.add(name, digest)

    def add(self, name: str, digest: str) -> None:
        digest = digest.strip().lower().removeprefix("sha256:")
        if not NAME.match(name):
            raise ConfigError(f"token entry name {name!r} must match {NAME.pattern}")
        if not HEX64.match(digest):
            raise ConfigError(f"token entry for {name!r} must be a sha256 hex digest (64 hex digits)")
        self._entries.append((bytes.fromhex(digest), name))

    def __len__(self) -> int:
        return len(self._entries)

    def who(self, token: str) -> str | None:
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, name in self._entries:  # no early exit: same work for every token
            if hmac.compare_digest(digest, presented):
                found = name
        return found

    @classmethod
    def parse(cls, items: Iterable[str], file: str | None = None, *, default_name: str | None = None) -> TokenTable:
        """Entries ``name:digest`` (or a bare digest when ``default_name`` is given), from the
        list and from ``file`` (one per line, ``#`` comments)."""
        lines = list(items)
        if file:
            try:
                with open(file) as f:
                    lines += [ln for ln in f.read().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            except OSError as e:
                raise ConfigError(f"cannot read token file: {e.strerror}") from None
        table = cls()
        for raw in lines:
            m = ENTRY.match(raw.strip())
            if m is None or (m.group(1) is None and default_name is None):
                raise ConfigError("token entries must be <name>:<sha256 hex digest>")
            table.add(m.group(1) or default_name or "", m.group(2))
        return table


def bearer(headers: Any) -> str | None:
    """The token of the request's one ``Authorization: Bearer`` header, or None — also when
    there are several Authorization headers: which one a component reads would otherwise depend
    on its header parser (first or last), so such a request is refused. ``headers`` is a list of
    (name, value) pairs, bytes (ASGI ``scope["headers"]``) or str (gRPC metadata), or a mapping."""
    found = None
    for name, value in (headers.items() if isinstance(headers, Mapping) else headers):
        if (name.decode("latin-1") if isinstance(name, bytes) else name).lower() == "authorization":
            if found is not None:
                return None
            found = value
    if not found:
        return None
    m = BEARER.match(found.decode("latin-1") if isinstance(found, bytes) else found)
    return m.group(1) if m else None


def authenticate(table: TokenTable, raw_headers: Any) -> str:
    """The caller's name for the request's headers (the ASGI ``scope["headers"]`` list)."""
    token = bearer(raw_headers)
    name = table.who(token) if token is not None else None
    if name is None:
        raise Unauthorized("missing or invalid bearer token")
    return name


class RegionAuth:
    """The allocator's check: the caller is a region with a valid token."""

    def __init__(self, table: TokenTable):
        self.table = table

    def __call__(self, connection: Any, handler: Any) -> None:
        if SCOPE_KEY not in connection.scope:  # once per request (the allocator's span middleware checks first)
            connection.scope[SCOPE_KEY] = authenticate(self.table, connection.scope["headers"])


def require_region(scope: Any, region: str) -> None:
    """403 when an authenticated region names another region (no-op with auth disabled)."""
    who = scope.get(SCOPE_KEY)
    if who is not None and who != region:
        raise Forbidden("a region may only request, report or view its own leases")
