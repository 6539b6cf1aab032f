"""What each service setting means, said once next to its field and read from there by
``--help``, the settings loader's checks and the services' option tables in the docs.

A settings Struct field carries its meaning as msgspec metadata (:func:`Help` returns a
``msgspec.Meta`` with ``description`` and ``extra``), beside any bounds it already has::

    port: Annotated[int, Meta(ge=0, le=65535), Help("HTTP listen port")] = 8080
    pepper_file: Annotated[str | None, Help("file holding the HMAC pepper", kind="file")] = None

:func:`options` turns a Struct into :class:`Option` records (flag, environment variable,
default, what values are valid) — one model for the argument parser, the environment reader,
the start-time checks (``kind``, ``requires``) and :func:`markdown_table`. A field without
``Help`` still works; a unit test requires one on every field of the shipped services.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import msgspec

from .ids import human

#: ``kind=`` values :mod:`kernel.config` checks at start
KINDS = ("file", "out-file", "url", "etcd-endpoints", "host")


def Help(text: str, *, default: str | None = None, kind: str | None = None, metavar: str | None = None,  # noqa: N802
         schemes: tuple[str, ...] | None = None, requires: tuple[str, ...] = (),
         section: str | None = None) -> msgspec.Meta:
    """The meaning of one setting (``description``) and how to check and show it (``extra``).

    ``default``: how ``--help`` and the docs show the default (e.g. ``"--host"`` for a ``None``
    that means "same as --host"); ``kind``: ``"file"`` (must be a readable file; each item of
    a list), ``"out-file"`` (its directory must exist), ``"url"`` (``scheme://...`` with a
    scheme in ``schemes``), ``"etcd-endpoints"``, ``"host"`` (an IP address or a host name); ``requires``: fields that must be set when
    this one is; ``section``: starts a group of options in ``--help`` and the docs (this field
    and the ones after it)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    extra: dict[str, Any] = {}
    for key, value in (("default", default), ("kind", kind), ("metavar", metavar), ("section", section)):
        if value is not None:
            extra[key] = value
    if schemes:
        extra["schemes"] = tuple(schemes)
    if requires:
        extra["requires"] = tuple(requires)
    return msgspec.Meta(description=text, extra=extra or None)


@dataclass(frozen=True)
class Option:
    """One setting of a service: its field, flag, environment variable and metadata."""

    name: str
    prefix: str
    type: Any
    default: Any  # msgspec.NODEFAULT when required
    help: str
    extra: dict[str, Any]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def negative_flag(self) -> str:
        return "--no-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return self.prefix + self.name.upper()

    @property
    def required(self) -> bool:
        return self.default is msgspec.NODEFAULT

    @property
    def base(self) -> Any:
        """The type without ``Annotated`` and ``None``: ``bool``, ``int``, ``str``, a ``Literal``,
        ``list[...]``."""
        return _base(self.type)

    @property
    def optional(self) -> bool:
        return _optional(self.type)

    @property
    def is_bool(self) -> bool:
        return self.base is bool

    @property
    def is_list(self) -> bool:
        return get_origin(self.base) in (list, tuple)

    @property
    def choices(self) -> tuple[Any, ...] | None:
        base = self.base
        return tuple(get_args(base)) if get_origin(base) is Literal else None

    @property
    def kind(self) -> str | None:
        return self.extra.get("kind")

    @property
    def section(self) -> str | None:
        return self.extra.get("section")

    @property
    def requires(self) -> tuple[str, ...]:
        return tuple(self.extra.get("requires", ()))

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self.extra.get("schemes", ()))

    @property
    def metavar(self) -> str | None:
        if self.is_bool:
            return None
        if "metavar" in self.extra:
            return str(self.extra["metavar"])
        if self.choices:
            return "{" + ",".join(str(c) for c in self.choices) + "}"
        if self.kind in ("file", "out-file"):
            return "FILE[,FILE...]" if self.is_list else "FILE"
        if self.kind == "url":
            return "URL[,URL...]" if self.is_list else "URL"
        if self.kind == "etcd-endpoints":
            return "ENDPOINTS"
        if self.kind == "host":
            return "HOST"
        if self.base is int:
            return "N"
        if self.base is float:
            return "X"
        return "A[,B...]" if self.is_list else "TEXT"

    def default_text(self) -> str:
        """The default as ``--help`` and the docs show it."""
        if "default" in self.extra:
            return str(self.extra["default"])
        if self.required:
            return "required"
        value = self.default
        if value is msgspec.NODEFAULT or value is None:
            return "unset"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return ",".join(str(v) for v in value) if value else "none"
        if value == "":
            return '""'
        return str(value)

    def valid_values(self) -> str:
        """What values are valid, in words (``one of: a, b``, ``an integer in [0, 65535]``)."""
        return describe(self.type, self.kind, self.schemes)

    def constraint(self, markdown: bool = False) -> str:
        """A short form of the bounds or pattern of a field, for ``--help`` and the docs
        (``0-65535``, ``matching [a-z0-9-]{1,32}``); empty when the type says it all."""
        for m in _metas(self.type):
            if m.ge is not None or m.le is not None:
                lo = m.ge if m.ge is not None else "-inf"
                hi = m.le if m.le is not None else "inf"
                return f"{lo}-{hi}"
            if m.pattern is not None:
                return f"matching `{human(m.pattern)}`" if markdown else f"matching {human(m.pattern)}"
        return ""

    def help_line(self) -> str:
        """The ``--help`` text: meaning, bounds or pattern, default."""
        parts = [p for p in (self.help.rstrip("."), self.constraint()) if p]
        tail = "(required)" if self.required and "default" not in self.extra else f"(default: {self.default_text()})"
        return "; ".join(parts) + " " + tail


def options(cls: type[msgspec.Struct], prefix: str) -> list[Option]:
    """The settings of ``cls``: its own fields in their order, then the ones it inherits (a
    service's options before the shared ``ServingSettings``)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: list[Option] = []
    for f in msgspec.structs.fields(cls):
        tp = hints[f.name]
        default = f.default
        if default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        description, extra = "", {}
        for meta in _metas(tp):
            if meta.description:
                description = meta.description
            if meta.extra:
                extra.update(meta.extra)
        out.append(Option(f.name, prefix, tp, default, description, extra))
    mro = [k for k in cls.__mro__ if isinstance(k, type) and issubclass(k, msgspec.Struct)]

    def depth(o: Option) -> int:
        return next((i for i, k in enumerate(mro) if o.name in k.__dict__.get("__annotations__", {})), len(mro))

    return sorted(out, key=depth)


def option_named(cls: type[msgspec.Struct], prefix: str, name: str) -> Option:
    for o in options(cls, prefix):
        if o.name == name:
            return o
    raise KeyError(name)


def markdown_table(cls: type[msgspec.Struct], prefix: str) -> str:
    """The options of ``cls`` as Markdown tables, one per section (the services' READMEs)."""
    lines: list[str] = []

    def head(title: str | None) -> None:
        if lines:
            lines.append("")
        if title:
            lines.extend([f"**{title}**", ""])
        lines.extend(["| option | environment | default | meaning |", "|---|---|---|---|"])

    started = False
    for o in options(cls, prefix):
        if o.section or not started:
            head(o.section)
            started = True
        flag = f"`{o.flag}`, `{o.negative_flag}`" if o.is_bool else f"`{o.flag} {o.metavar}`"
        meaning = _cell(o.help) + (f" ({_cell(o.constraint(markdown=True))})" if o.constraint() else "")
        literal = "default" not in o.extra and not o.required and o.default not in (None, [])
        default = f"`{o.default_text()}`" if literal else _cell(o.default_text())
        lines.append(f"| {flag} | `{o.env}` | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- type introspection -------------------------------------------------------------------------
def _metas(tp: Any) -> list[msgspec.Meta]:
    out: list[msgspec.Meta] = []
    if get_origin(tp) is typing.Annotated:
        base, *meta = get_args(tp)
        out += _metas(base)
        out += [m for m in meta if isinstance(m, msgspec.Meta)]
    elif _is_union(tp):
        for a in get_args(tp):
            out += _metas(a)
    return out


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType)


def _optional(tp: Any) -> bool:
    if get_origin(tp) is typing.Annotated:
        return _optional(get_args(tp)[0])
    return _is_union(tp) and type(None) in get_args(tp)


def _base(tp: Any) -> Any:
    if get_origin(tp) is typing.Annotated:
        return _base(get_args(tp)[0])
    if _is_union(tp):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _base(args[0]) if len(args) == 1 else tp
    return tp


def describe(tp: Any, kind: str | None = None, schemes: tuple[str, ...] = ()) -> str:
    """The valid values of a type, in words."""
    if kind == "url":
        start = " starting with " + " or ".join(f"{s}://" for s in schemes) if schemes else ""
        return f"comma-separated URLs{start}" if get_origin(_base(tp)) in (list, tuple) else f"a URL{start}"
    if kind == "etcd-endpoints":
        return "comma-separated etcd endpoints host:port, http://host:port or https://host:port"
    if kind == "host":
        return "an IP address or a host name"
    if kind in ("file", "out-file"):
        return "comma-separated file paths" if get_origin(_base(tp)) in (list, tuple) else "a file path"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in get_args(tp))
    if _is_union(tp):
        return " or ".join(describe(a) for a in get_args(tp) if a is not type(None))
    if origin is typing.Annotated:
        base, *meta = get_args(tp)
        desc = describe(base)
        for m in meta:
            if not isinstance(m, msgspec.Meta):
                continue
            if m.ge is not None or m.le is not None:
                lo = m.ge if m.ge is not None else "-inf"
                hi = m.le if m.le is not None else "inf"
                desc = f"an integer in [{lo}, {hi}]" if base is int else f"{desc} in [{lo}, {hi}]"
            if m.pattern is not None:
                desc = f"text matching {human(m.pattern)}"
        return desc
    if origin in (list, tuple):
        (inner,) = get_args(tp)[:1] or (str,)
        item = describe(inner)
        return "comma-separated list" + ("" if item == "text" else f" of {item}")
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "text"
    return getattr(tp, "__name__", str(tp))


__all__ = ["Help", "KINDS", "Option", "describe", "markdown_table", "option_named", "options"]
