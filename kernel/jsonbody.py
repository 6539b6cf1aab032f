"""Strict JSON request bodies for both services (one definition, also used by the agent's fast path).

Litestar parses a body with any content type as JSON, decodes it *generically* first (a body
of 2,000 nested ``[`` overflowed the recursion limit: a 500 with a traceback) and then converts
it with ``strict=False`` (``"want": "1"`` and ``"want": 1e3`` became integers); duplicate keys
silently kept the last value. Here a body is accepted only when

* its ``Content-Type`` is ``application/json`` (one header; parameters allowed, a charset only
  if it is UTF-8) — anything else, or none, is ``415``;
* it decodes *typed and strict* straight into the route's msgspec Struct: no coercion of strings
  or floats into integers, no unknown fields; the decoder follows the schema, so nesting deeper
  than the schema (at most 4 levels: batch → items → item → principal) fails at the first extra
  level without recursion — ``400`` for malformed JSON (bad UTF-8, a NUL byte, truncation),
  the service's validation status for a body that does not fit the schema;
* no object in it repeats a key (``400``), checked after the typed decode succeeded.

:class:`StrictJSONRequest` plugs this into Litestar (``Litestar(request_class=...)``): Litestar
calls ``request.json()`` for a ``data`` parameter and passes a Struct instance through
unchanged, so a body is decoded once. Rejections are logged as one short line per route and
reason, at most once a second (:func:`note_rejection`).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import msgspec
from litestar import Request
from litestar.exceptions import ClientException, ValidationException
from litestar.types import Empty

from .errors import UnsupportedMediaType
from .ratelog import KeyedLog

log = logging.getLogger(__name__)

_GENERIC = msgspec.json.Decoder()
_WS_BEFORE_COLON = re.compile(rb'"\s+:')  # whitespace between a closing quote and a colon (\s: b" \t\n\r\x0b\x0c")


def ws_before_colon(body: bytes) -> bool:
    """Whether ``_WS_BEFORE_COLON`` is found in ``body``, the regex engine asked only when it may be:
    a match is a quote, whitespace, a colon, so a body without whitespace has none (a byte's
    membership is a memchr, ~5 % of the search), and one whose only whitespace is spaces has none
    unless a quote is followed by a space."""
    if 9 in body or 10 in body or 13 in body or 11 in body or 12 in body:  # \t \n \r \x0b \x0c
        return _WS_BEFORE_COLON.search(body) is not None
    return 32 in body and body.find(b'" ') >= 0 and _WS_BEFORE_COLON.search(body) is not None


_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


class BodyRejected(ClientException):
    """A malformed body (400): not JSON, bad UTF-8, repeated keys."""


def is_json_media_type(value: str | None) -> bool:
    """``application/json``, optionally with parameters; a charset must be UTF-8."""
    if not value:
        return False
    media, _, params = value.partition(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params.split(";"):
        name, _, val = param.partition("=")
        if name.strip().lower() == "charset" and val.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def content_type_of(raw_headers: Any) -> str | None:
    """The one Content-Type of an ASGI header list; 415 when there are several."""
    found = [v for k, v in raw_headers if k.lower() == b"content-type"]
    if len(found) > 1:
        raise UnsupportedMediaType("more than one Content-Type header")
    return found[0].decode("latin-1") if found else None


def check_content_type(value: str | None) -> None:
    if not is_json_media_type(value):
        shown = (value or "none")[:60]
        raise UnsupportedMediaType(f"request bodies must be application/json (got {shown})",
                                   extra={"accept": "application/json"})


def decoder_for(model: type) -> msgspec.json.Decoder[Any]:
    dec = _decoders.get(model)
    if dec is None:
        dec = _decoders[model] = msgspec.json.Decoder(model)  # strict=True: no coercion
    return dec


def has_duplicate_keys(body: bytes) -> bool:
    """Whether any object of ``body`` (valid JSON) repeats a key.

    Fast path, exact: without a backslash no string can contain a quote, and without whitespace
    between a closing quote and a colon every key ends in ``":``; ``count('":')`` then equals
    (key occurrences + strings beginning with a colon), which equals the number of *distinct*
    keys only when no key repeats. Anything else goes through the exact slow path."""
    if 92 not in body and not ws_before_colon(body):  # 92: a backslash (an int in bytes raises nothing inside)
        if body.count(b'":') == _count_keys(_GENERIC.decode(body)):
            return False
    try:
        json.loads(body, object_pairs_hook=_refuse_repeats)
    except _Repeated:
        return True
    except (ValueError, RecursionError):
        return False  # not ours to judge here: the typed decode decided the body is valid
    return False


def repeats_keys(body: bytes, present: int) -> bool:
    """:func:`has_duplicate_keys` with a shortcut for a body already decoded into its schema:
    ``present`` is a lower bound of its distinct keys (the fields its typed value shows must have
    been in the body, e.g. required ones and those different from their default). Under the fast
    path's preconditions ``count('":')`` is (key occurrences + strings beginning with a colon),
    which is at least the distinct keys and so at least ``present``: equality leaves no room for a
    repeated key. Anything else is judged by :func:`has_duplicate_keys`."""
    if 92 not in body and body.count(b'":') == present and not ws_before_colon(body):  # 92: a backslash
        return False
    return has_duplicate_keys(body)


class _Repeated(Exception):
    pass


def _refuse_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Repeated
    return out


def _count_keys(value: Any) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_count_keys(v) for v in value.values() if isinstance(v, (dict, list)))
    if isinstance(value, list):
        return sum(_count_keys(v) for v in value if isinstance(v, (dict, list)))
    return 0


def decode_strict(body: bytes, model: type) -> Any:
    """``body`` as a ``model`` instance, strictly; raises :class:`BodyRejected` (400) or Litestar's
    ``ValidationException`` (the service's own mapping gives its validation status)."""
    try:
        value = decoder_for(model).decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        message, _, where = text.partition(" - at `")
        key = where.rstrip("`").removeprefix("$").lstrip(".") or None
        raise ValidationException(detail=f"request body failed validation: {text}",
                                  extra=[{"message": message, "key": key, "source": "body"}]) from None
    except msgspec.DecodeError as e:
        raise BodyRejected(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # not reachable with bounded schemas; kept as a 400 all the same
        raise BodyRejected("request body nests too deeply") from None
    if has_duplicate_keys(body):
        raise BodyRejected("request body repeats a key in one object")
    return value


class StrictJSONRequest(Request[Any, Any, Any]):
    """Litestar request whose ``json()`` is :func:`decode_strict` into the route's ``data`` type.

    Litestar does not call ``json()`` for an empty body (it passes "no data" on, and a required
    ``data`` then failed validation as ``"data: 'data'"``, whatever the content type): ``body()``
    refuses an empty body of a route that requires one as the decode would, content type first."""

    async def body(self) -> bytes:
        body = await super().body()
        if not body:
            field = self.route_handler.parsed_data_field
            if field is not None and not field.is_optional and not field.has_default:
                check_content_type(content_type_of(self.scope["headers"]))
                raise BodyRejected("request body is empty: a JSON document is required")
        return body

    async def json(self) -> Any:
        if self._json is not Empty:
            return self._json
        check_content_type(content_type_of(self.scope["headers"]))
        body = await self.body()
        field = self.route_handler.parsed_data_field
        model = field.annotation if field is not None else None
        if not isinstance(model, type) or not issubclass(model, msgspec.Struct):
            value: Any = decode_strict(body, Any) if body else None
        else:
            value = decode_strict(body, model)
        self._json = value
        return value


_rejections = KeyedLog(log, interval_s=1.0)


def note_rejection(path: str, status: int, detail: str) -> None:
    """One short INFO line for a refused request, at most one per route and status a second
    (the next line says how many were not logged)."""
    _rejections.log((path, status), logging.INFO, f"refused {status} {path[:80]}: {detail[:160]}")
