"""Log lines of both services: ``--log-format text`` (the default, for people) or ``json`` (one
object per line, for a log pipeline), one schema for every logger, uvicorn's included:

``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``; and when the line
is about one decision or request, ``decision_id`` / ``request_id`` (from the call's ``extra`` or
from the decision being traced), ``trace_id`` / ``span_id`` while a span is active
(region_agent.service.tracing), ``exception`` with the traceback.

A line is one line whatever a client sent: a message can carry client bytes (the unknown field
name a refused body named, a path), so the text format writes its control characters (C0, DEL,
C1) and Unicode line and paragraph separators escaped (``\\n``, ``\\x1b``, ``\\u2028``), and
the JSON format escapes the separators that ``json.dumps`` leaves raw (``\\u0085``,
``\\u2028``, ``\\u2029``: ``str.splitlines`` and other line readers split on them). A
traceback (``exception``) keeps its own newlines.

The audit trail of privileged bypasses is not a log: it goes to its own file
(``--audit-log``, region_agent.service.audit).
"""

from __future__ import annotations

import contextvars
import json
import logging
import logging.config
import re
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ID_FIELDS = ("decision_id", "request_id", "lease_id")
# the decision a log line is about, while one is being traced (set by region_agent.service.tracing)
CURRENT_DECISION: contextvars.ContextVar[str | None] = contextvars.ContextVar("leasehold_decision", default=None)
_trace_ids: Any = None  # set by kernel.tracing when tracing is on: () -> (trace_id, span_id) | None


# what would end a line or drive a terminal: C0 controls, DEL, C1 controls, line/paragraph separators
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# the separators json.dumps(ensure_ascii=False) writes raw
_JSON_UNSAFE = re.compile("[\x85\u2028\u2029]")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _SHORT.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def one_line(text: str) -> str:
    """``text`` with every character that could end a log line or drive a terminal escaped."""
    return _UNSAFE.sub(_escape, text)


def set_trace_ids(fn: Any) -> None:
    global _trace_ids
    _trace_ids = fn


class JsonFormatter(logging.Formatter):
    """One JSON object per record, in the schema above."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ID_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = str(value)
        if "decision_id" not in out and (current := CURRENT_DECISION.get()) is not None:
            out["decision_id"] = current
        if _trace_ids is not None and (ids := _trace_ids()) is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exception"] = self.formatStack(record.stack_info)
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(out, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, the message on one line (module doc); a traceback follows as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = one_line(record.message)
        return super().formatMessage(record)


def log_config(level: str = "info", fmt: LogFormat = "text") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` document: the root logger and uvicorn's loggers write to
    stderr in ``fmt``; HTTP client request lines only at debug. Also given to uvicorn, so every
    worker process configures itself the same way."""
    formatter: dict[str, Any] = ({"()": "kernel.logs.JsonFormatter"} if fmt == "json"
                                 else {"()": "kernel.logs.TextFormatter", "fmt": TEXT_FORMAT})
    lvl = level.upper()
    quiet = "WARNING" if lvl != "DEBUG" else "DEBUG"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"leasehold": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "leasehold",
                                "stream": "ext://sys.stderr"}},
        "root": {"level": lvl, "handlers": ["stderr"]},
        "loggers": {
            **{name: {"level": lvl, "handlers": [], "propagate": True}
               for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
            "httpx": {"level": quiet}, "httpcore": {"level": quiet},
        },
    }


def configure(level: str = "info", fmt: LogFormat = "text") -> dict[str, Any]:
    """Configure this process's logging; returns the document (for uvicorn's workers)."""
    doc = log_config(level, fmt)
    logging.config.dictConfig(doc)
    return doc


__all__ = ["CURRENT_DECISION", "ID_FIELDS", "JsonFormatter", "LogFormat", "TextFormatter", "configure", "log_config",
           "one_line", "set_trace_ids"]
