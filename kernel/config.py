"""Settings loading shared by both services: one msgspec Struct per service, filled from
``--option`` flags, then ``<PREFIX><FIELD>`` environment variables, then defaults, and
validated at start with messages that list the valid values."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

import msgspec

from .version import version_line

T = TypeVar("T", bound=msgspec.Struct)
Ms = msgspec.Meta


class ConfigError(SystemExit):
    """Raised for bad settings; exits with status 2 and a readable message."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    if origin is typing.Annotated:
        base, *meta = get_args(tp)
        bounds = [m for m in meta if isinstance(m, msgspec.Meta)]
        desc = _describe(base)
        for m in bounds:
            if m.ge is not None or m.le is not None:
                desc += f" in [{m.ge if m.ge is not None else '-inf'}, {m.le if m.le is not None else 'inf'}]"
        return desc
    if origin in (list, tuple):
        return "comma-separated list"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, raw: str) -> Any:
    origin = get_origin(tp)
    if origin is typing.Annotated:
        return _coerce(get_args(tp)[0], raw)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in get_args(tp) if a is not type(None)]
        if raw == "" and len(args) < len(get_args(tp)):
            return None
        return _coerce(args[0], raw) if len(args) == 1 else raw
    if origin in (list, tuple):
        (inner,) = get_args(tp)[:1] or (str,)
        return [_coerce(inner, x.strip()) for x in raw.split(",") if x.strip()]
    if tp is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return raw
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            return raw
    return raw


def load_settings(cls: type[T], prefix: str, argv: Sequence[str] | None = None,
                  env: dict[str, str] | None = None, prog: str | None = None) -> T:
    env = dict(os.environ if env is None else env)
    hints = typing.get_type_hints(cls, include_extras=True)
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip().splitlines()[0]
                                     if cls.__doc__ else None)
    parser.add_argument("--version", action="version", version=version_line(prog or parser.prog))
    for name in cls.__struct_fields__:
        parser.add_argument(_flag(name), dest=name, default=None,
                            help=f"{_describe(hints[name])} (env {prefix}{name.upper()})")
    args = parser.parse_args(list(argv) if argv is not None else [])
    values: dict[str, Any] = {}
    for name in cls.__struct_fields__:
        raw = getattr(args, name)
        if raw is None:
            raw = env.get(prefix + name.upper())
        if raw is None:
            continue
        values[name] = _coerce(hints[name], raw)
    try:
        return msgspec.convert(values, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        field = msg.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in msg else None
        if field and field in hints:
            raise ConfigError(
                f"invalid setting {_flag(field)} / {prefix}{field.upper()}: {msg}; "
                f"expected {_describe(hints[field])}") from None
        raise ConfigError(f"invalid settings: {msg}") from None


def settings_flags(cls: type[msgspec.Struct], values: dict[str, Any]) -> list[str]:
    """The command-line flags that :func:`load_settings` reads back as ``values`` (the inverse):
    ``--field-name value`` per entry; lists comma-joined, booleans ``true``/``false``, ``None``
    left out. A name that is not a field of ``cls`` is a ``ValueError`` (a typo fails at once,
    not as an unknown flag in a child process's log)."""
    out: list[str] = []
    for name, value in values.items():
        if name not in cls.__struct_fields__:
            raise ValueError(f"{cls.__name__} has no setting {name!r}")
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        out += [_flag(name), text]
    return out


class ServingSettings(msgspec.Struct, kw_only=True, frozen=True):
    """How a service is served: the settings both services share (inherited by ``AgentSettings``
    and ``AllocatorSettings``; ``--flags`` and env vars as for their own fields)."""

    tls_cert_file: str | None = None  # serve HTTPS (uvicorn ssl_certfile) ...
    tls_key_file: str | None = None  # ... with this key
    access_log: bool = False  # one line per HTTP request (uvicorn's access log); off by default
    http_max_header_bytes: typing.Annotated[int, Ms(ge=1_024, le=1_048_576)] = 16_384  # request line + headers: 431
    http_max_headers: typing.Annotated[int, Ms(ge=8, le=1_000)] = 100  # header fields per request: 431
    http_header_timeout_ms: typing.Annotated[int, Ms(ge=100, le=600_000)] = 10_000  # head complete within: 408
    http_body_timeout_ms: typing.Annotated[int, Ms(ge=100, le=600_000)] = 10_000  # body complete after the head: 408

    def http_limits(self) -> Any:
        """The :class:`kernel.httpserver.HttpLimits` these settings ask for."""
        from .httpserver import HttpLimits
        return HttpLimits(max_header_bytes=self.http_max_header_bytes, max_headers=self.http_max_headers,
                          header_timeout_s=self.http_header_timeout_ms / 1000,
                          body_timeout_s=self.http_body_timeout_ms / 1000)
