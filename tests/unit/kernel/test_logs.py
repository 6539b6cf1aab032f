"""kernel.logs: a message is one line in either format; a traceback keeps its lines."""

from __future__ import annotations

import json
import logging

from kernel.logs import JsonFormatter, TextFormatter, log_config, one_line


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys
            exc_info = sys.exc_info()
    return logging.LogRecord("t", logging.INFO, __file__, 1, msg, args, exc_info)


def test_one_line_escapes_what_ends_a_line_or_drives_a_terminal():
    assert one_line("a\nb\rc\td\x1b[2J\x00\x7f\x85\x9b\u2028\u2029é€") == \
        "a\\nb\\rc\\td\\x1b[2J\\x00\\x7f\\x85\\x9b\\u2028\\u2029é€"


def test_the_text_format_writes_a_message_on_one_line_and_the_traceback_after_it():
    fmt = TextFormatter(log_config()["formatters"]["leasehold"]["fmt"])
    out = fmt.format(_record("refused %s", "x\nFORGED", exc=True))
    first, *rest = out.split("\n")
    assert first.endswith("t: refused x\\nFORGED")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"


def test_a_json_line_has_no_character_a_line_reader_splits_on():
    out = JsonFormatter().format(_record("m %s", "a\u2028b\u2029c\x85d\ne"))
    assert out.splitlines() == [out]
    assert json.loads(out)["message"] == "m a\u2028b\u2029c\x85d\ne"
