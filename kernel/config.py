"""Settings loading shared by both services: one msgspec Struct per service, filled from
``--option`` flags, then ``<PREFIX><FIELD>`` environment variables, then defaults, and
validated at start with messages that list the valid values.

What each option means, its default and what is valid come from the field itself
(:mod:`kernel.options`): ``--help``, the checks below and the READMEs' option tables all read
it there. Switches (``bool`` fields) are ``--x`` / ``--no-x`` on the command line and
``true`` / ``false`` in the environment."""

from __future__ import annotations

import argparse
import os
import re
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin
from urllib.parse import urlsplit

import msgspec

from .options import Help, Option, options
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


LogLevel = Literal["debug", "info", "warning", "error"]
BOOL_WORDS = {"true": True, "false": False}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (the full usage of a service is dozens of
    options long) as a :class:`ConfigError`."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser(cls: type[msgspec.Struct], prefix: str, prog: str | None = None,
                 epilog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of a settings Struct: one flag per field (switches as ``--x`` /
    ``--no-x``), help text from the fields' :func:`kernel.options.Help`, grouped by section."""
    doc = (cls.__doc__ or "").strip()
    tail = (f"Every option can also be set in the environment as {prefix}<OPTION> (upper case, "
            f"'-' as '_'; e.g. {prefix}LOG_LEVEL=debug, switches as true or false); a flag wins over "
            "the environment, the environment over the default. Invalid settings are refused at "
            "start with a message and exit status 2.")
    parser = _Parser(prog=prog, usage="%(prog)s [options]", description=doc.splitlines()[0] if doc else None,
                     epilog=tail + ("\n\n" + epilog if epilog else ""), allow_abbrev=False,
                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="print the version and build commit, and exit")
    group: Any = parser
    for o in options(cls, prefix):
        if o.section:
            group = parser.add_argument_group(o.section)
        text = o.help_line().replace("%", "%%")
        if o.is_bool:
            group.add_argument(o.flag, dest=o.name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            group.add_argument(o.flag, dest=o.name, default=None, metavar=o.metavar, help=text)
    return parser


def _reject_valued_switches(argv: Sequence[str], opts: list[Option]) -> None:
    """``--auth-disabled true`` (the old form) is refused with the new spelling, not taken as a
    stray argument."""
    switches = {o.flag: o for o in opts if o.is_bool} | {o.negative_flag: o for o in opts if o.is_bool}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in switches:
            continue
        if not eq:  # the services take no positional arguments: a word after a switch is its value
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                continue
            value = argv[i + 1]
        o = switches[flag]
        raise ConfigError(f"{flag} is a switch and takes no value (got {value!r}): write {o.flag} to turn it "
                          f"on or {o.negative_flag} to turn it off")


def _label(o: Option, source: str) -> str:
    return o.flag if source == "flag" else f"{o.env} ({o.flag})"


def _coerce(o: Option, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        return raw  # a switch from the command line: already a bool
    if raw == "" and o.optional:
        return None
    if o.is_list:
        inner = get_args(o.base)[:1] or (str,)
        items = [x.strip() for x in raw.split(",") if x.strip()]
        return [_scalar(o, inner[0], x, source) for x in items]
    return _scalar(o, o.base, raw, source)


def _scalar(o: Option, tp: Any, raw: str, source: str) -> Any:
    if get_origin(tp) is typing.Annotated:
        tp = get_args(tp)[0]
    if tp is bool:
        value = BOOL_WORDS.get(raw.strip().lower())
        if value is None:
            raise ConfigError(f"invalid value {raw!r} for {_label(o, source)}: expected true or false")
        return value
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"invalid value {raw!r} for {_label(o, source)}: expected "
                              f"{o.valid_values()}") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"invalid value {raw!r} for {_label(o, source)}: expected "
                              f"{o.valid_values()}") from None
    return raw


def load_settings(cls: type[T], prefix: str, argv: Sequence[str] | None = None,
                  env: dict[str, str] | None = None, prog: str | None = None, epilog: str | None = None) -> T:
    """Settings from ``argv`` flags, then ``<prefix><FIELD>`` environment variables, then the
    field defaults; every value checked (types, bounds, choices, files, URLs, options that need
    another) with a :class:`ConfigError` that names the option and lists the valid values."""
    env = dict(os.environ if env is None else env)
    argv = list(argv) if argv is not None else []
    opts = options(cls, prefix)
    by_name = {o.name: o for o in opts}
    _reject_valued_switches(argv, opts)
    args = build_parser(cls, prefix, prog, epilog).parse_args(argv)
    values: dict[str, Any] = {}
    sources: dict[str, tuple[str, Any]] = {}
    for o in opts:
        raw, source = getattr(args, o.name), "flag"
        if raw is None:
            raw, source = env.get(o.env), "env"
        if raw is None:
            continue
        sources[o.name] = (source, raw)
        values[o.name] = _coerce(o, raw, source)
    # a required setting given empty (``--etcd ''``, ``LEASEHOLD_ALLOCATOR_ETCD=`` left blank in an
    # env file) is missing: its checks skip empty values, so it would fail later, as a traceback
    missing = [o for o in opts if o.required and (o.name not in values or values[o.name] in ("", []))]
    if missing:
        raise ConfigError("missing required setting" + ("s " if len(missing) > 1 else " ") + "; ".join(
            f"{o.flag} (or {o.env}): {o.help or o.valid_values()}" for o in missing))
    try:
        settings = msgspec.convert(values, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.search(r"at `\$\.(\w+)", msg)
        bad = by_name.get(m.group(1)) if m else None
        if bad is None:
            raise ConfigError(f"invalid settings: {msg}") from None
        source, raw = sources.get(bad.name, ("flag", values.get(bad.name)))
        raise ConfigError(f"invalid value {raw!r} for {_label(bad, source)}: expected {bad.valid_values()}") from None
    for o in opts:
        if o.name in values:
            _check(o, getattr(settings, o.name), sources[o.name][0], settings, by_name)
    if isinstance(settings, ServingSettings):
        check_tls("--tls-cert-file / --tls-key-file", settings.tls_cert_file, settings.tls_key_file)
    return settings


def check_tokens(what: str, items: list[str], file: str | None, default_name: str | None = None) -> None:
    """Token entries (:meth:`kernel.auth.TokenTable.parse`) checked at start, naming the options."""
    from .auth import TokenTable

    try:
        TokenTable.parse(items, file, default_name=default_name)
    except ConfigError as e:
        raise ConfigError(f"invalid {what}: {e.message}") from None


def check_tls(what: str, cert: str | None = None, key: str | None = None, ca: str | None = None) -> None:
    """:func:`kernel.tlsfiles.check_tls_files` as a :class:`ConfigError` naming the options."""
    from .tlsfiles import check_tls_files

    try:
        check_tls_files(cert, key, ca)
    except ValueError as e:
        raise ConfigError(f"invalid {what}: {e}") from None


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != ""


def _check(o: Option, value: Any, source: str, settings: Any, by_name: dict[str, Option]) -> None:
    """The checks a field's ``Help(kind=..., requires=...)`` asks for."""
    if not _is_set(value):
        return
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        problem = _problem(o, str(item))
        if problem:
            shown = _without_userinfo(str(item)) if o.kind == "url" else str(item)
            raise ConfigError(f"invalid value {shown!r} for {_label(o, source)}: {problem}")
    for other in o.requires:
        if not _is_set(getattr(settings, other)):
            need = by_name[other]
            raise ConfigError(f"{_label(o, source)} needs {need.flag} (or {need.env}) as well")


def _without_userinfo(url: str) -> str:
    """A URL as an error message may show it: whatever stands before its last ``@`` (a user and
    password, percent-encoded or not) replaced by ``…``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    return (scheme + sep if sep else "") + "…@" + rest.rsplit("@", 1)[1]


def _problem(o: Option, item: str) -> str | None:
    if o.kind == "file":
        if not os.path.exists(item):
            return "no such file"
        if not os.path.isfile(item):
            return "not a regular file"
        if not os.access(item, os.R_OK):
            return "not readable by this process"
    elif o.kind == "out-file":
        parent = os.path.dirname(os.path.abspath(item))
        if not os.path.isdir(parent):
            return f"its directory {parent} does not exist"
    elif o.kind == "url":
        parts = urlsplit(item)
        # a unix:// URL names a socket's path, not a host (unix:///run/redis.sock)
        where = parts.path.strip("/") if parts.scheme == "unix" else parts.netloc
        if (o.schemes and parts.scheme not in o.schemes) or not where:
            return "expected a URL" + (" starting with " + " or ".join(f"{x}://" for x in o.schemes)
                                       if o.schemes else "")
        hosts = parts.netloc.rpartition("@")[2].split(",")  # (redis+cluster:// and +sentinel:// name several)
        if any(h.count(":") > 1 and "[" not in h for h in hosts):  # http://fd00::1:8080
            return "an IPv6 address in a URL goes in brackets, e.g. http://[fd00::1]:8080"
    elif o.kind == "host":
        if not _host_ok(item):
            return "expected an IP address or a host name"
    elif o.kind == "etcd-endpoints":
        from .etcd_endpoints import parse_endpoints

        try:
            parse_endpoints(item)
        except ValueError as e:
            return str(e)
    return None


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def _host_ok(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(x) for x in labels):
        return False
    return not all(x.isdigit() for x in labels)  # 999.1.1.1 is a bad address, not a name


def settings_flags(cls: type[msgspec.Struct], values: dict[str, Any]) -> list[str]:
    """The command-line flags that :func:`load_settings` reads back as ``values`` (the inverse):
    ``--field-name value`` per entry, switches as ``--field-name`` / ``--no-field-name``; lists
    comma-joined, ``None`` left out. A name that is not a field of ``cls`` is a ``ValueError`` (a
    typo fails at once, not as an unknown flag in a child process's log)."""
    out: list[str] = []
    for name, value in values.items():
        if name not in cls.__struct_fields__:
            raise ValueError(f"{cls.__name__} has no setting {name!r}")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
            continue
        if isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        out += [_flag(name), text]
    return out


class ServingSettings(msgspec.Struct, kw_only=True, frozen=True):
    """How a service is served: the settings both services share (inherited by ``AgentSettings``
    and ``AllocatorSettings``; ``--flags`` and env vars as for their own fields)."""

    tls_cert_file: Annotated[str | None, Help(
        "serve HTTPS with this certificate chain (PEM); plain HTTP when unset", kind="file",
        requires=("tls_key_file",), section="HTTP serving")] = None
    tls_key_file: Annotated[str | None, Help(
        "the private key (PEM) of --tls-cert-file", kind="file", requires=("tls_cert_file",))] = None
    access_log: Annotated[bool, Help("one log line per HTTP request (uvicorn's access log)")] = False
    http_max_header_bytes: Annotated[int, Ms(ge=1_024, le=1_048_576), Help(
        "largest request line plus headers in bytes; larger: 431")] = 16_384
    http_max_headers: Annotated[int, Ms(ge=8, le=1_000), Help(
        "most header fields per request; more: 431")] = 100
    http_header_timeout_ms: Annotated[int, Ms(ge=100, le=600_000), Help(
        "a request's head must be complete this many ms after the connection opened or its "
        "first byte arrived; else 408")] = 10_000
    http_body_timeout_ms: Annotated[int, Ms(ge=100, le=600_000), Help(
        "a request's body must arrive within this many ms after its head; else 408")] = 10_000
    http_write_timeout_ms: Annotated[int, Ms(ge=100, le=600_000), Help(
        "a client that reads none of its answers for this many ms, while they wait to be written, "
        "has its connection reset")] = 10_000
    http_max_connections: Annotated[int, Ms(ge=16, le=1_000_000), Help(
        "most HTTP connections a process keeps open (each worker its own); one more is answered "
        "503 (problem+json) and closed")] = 1_000
    http_keepalive_s: Annotated[int, Ms(ge=1, le=3_600), Help(
        "close a connection idle this many seconds between requests; keep it above the idle "
        "timeout of the clients' pooled connections (the gateways': docs/gateways.md)")] = 120
    log_format: Annotated[Literal["text", "json"], Help(
        "log lines as text, or as one JSON object per line (time, level, logger, message, ids)",
        section="Logs and tracing")] = "text"
    otlp_endpoint: Annotated[str | None, Help(
        "OpenTelemetry tracing: the OTLP/gRPC collector, e.g. http://127.0.0.1:4317", kind="url",
        schemes=("http", "https"), default="off")] = None
    trace_sample_ratio: Annotated[float, Ms(ge=0.0, le=1.0), Help(
        "share of new traces sampled (a gateway's sampled flag is followed)")] = 1.0

    def http_limits(self) -> Any:
        """The :class:`kernel.httpserver.HttpLimits` these settings ask for."""
        from .httpserver import HttpLimits
        return HttpLimits(max_header_bytes=self.http_max_header_bytes, max_headers=self.http_max_headers,
                          header_timeout_s=self.http_header_timeout_ms / 1000,
                          body_timeout_s=self.http_body_timeout_ms / 1000,
                          write_timeout_s=self.http_write_timeout_ms / 1000,
                          max_connections=self.http_max_connections, keepalive_s=self.http_keepalive_s)
