"""One output convention for every ``leasehold`` command, and its exit codes.

* ``-o text`` (the default) prints lines for people; ``-o json`` prints exactly one JSON
  document on stdout — the command's result, or ``{"error": {...}}`` when it fails — so a
  script can always pipe stdout to ``jq``.
* Diagnostics (what went wrong, progress) go to stderr in both formats, one line
  ``leasehold: <message>`` plus indented details; never a traceback (``LEASEHOLD_DEBUG=1``
  shows one for an unexpected error).
* The exit code says what happened (:class:`Exit`; the table is in ``leasehold --help`` and
  ``docs/cli.md``, both generated from :data:`MEANINGS`).

A command is a function ``(args) -> int`` that returns ``out(args).result(data, text)`` on
success and raises :class:`Failure` otherwise; :func:`run` turns a ``Failure`` into the stderr
line, the JSON error document and the exit code. :func:`add_output_option` gives a parser
``-o/--output``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, TextIO

FORMATS = ("text", "json")


class Exit(IntEnum):
    OK = 0
    DIFFERS = 1
    USAGE = 2
    DENIED = 3
    UNAVAILABLE = 4
    CONNECT = 5
    NOT_RUNNING = 6
    BYPASS = 7
    WORSE = 8
    INTERNAL = 70  # sysexits.h EX_SOFTWARE


#: what each exit code means (``leasehold --help`` and ``docs/cli.md``)
MEANINGS: dict[Exit, str] = {
    Exit.OK: "success; for `admit`, the request is allowed; for `status`, every service is up and ready",
    Exit.DIFFERS: "`policy fmt --check`: the file is not in canonical form",
    Exit.USAGE: "bad usage or invalid input: an unknown option, a malformed, unsigned or wrongly signed "
                "bundle, a refused publish; `policy show`: the published value or the staged canary is one the "
                "services refuse",
    Exit.DENIED: "`admit`: the request was denied (429); `policy publish`: refused because the version is not "
                 "higher than the last one published, or the bundle was made over another than the published one",
    Exit.UNAVAILABLE: "the agent or allocator answered unavailable (503); `status`: a service is running "
                      "but not ready",
    Exit.CONNECT: "could not connect (agent, allocator or etcd); `status`: a service of the topology is down",
    Exit.NOT_RUNNING: "no local topology is running (or nothing is published in etcd, for `policy show`)",
    Exit.BYPASS: "`policy validate --against`, `policy diff`: the bundle is valid but adds or widens a privileged "
                 "bypass",
    Exit.WORSE: "`policy replay`: a rule's denial rate rises by more than `--threshold`; `policy status`: the "
                "canary denies more than the rest by over `--margin`",
    Exit.INTERNAL: "an unexpected error (a bug: please report it with the output of `LEASEHOLD_DEBUG=1`)",
}


class Failure(Exception):
    """A command's failure: exit ``code``, a one-line ``message``, optional detail lines and
    extra JSON fields."""

    def __init__(self, code: Exit, message: str, details: Sequence[str] = (), **data: Any):
        super().__init__(message)
        self.code = Exit(code)
        self.message = message
        self.details = list(details)
        self.data = data


class Output:
    """Where and how a command writes (``-o text|json``)."""

    def __init__(self, fmt: str = "text", stdout: TextIO | None = None, stderr: TextIO | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"output format must be one of {', '.join(FORMATS)}")
        self.format = fmt
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    @property
    def json(self) -> bool:
        return self.format == "json"

    def result(self, data: Any, text: str | Callable[[Any], str] | None = None, code: Exit = Exit.OK) -> int:
        """Print a command's result: ``data`` as JSON, or ``text`` (a string or a function of
        ``data``; JSON when none is given) for people. Returns ``code``."""
        if self.json or text is None:
            self.stdout.write(json.dumps(data, indent=2) + "\n")
        else:
            body = text(data) if callable(text) else text
            if body:
                self.stdout.write(body.rstrip("\n") + "\n")
        self.stdout.flush()
        return int(code)

    def note(self, message: str) -> None:
        """A diagnostic or progress line (stderr, both formats)."""
        self.stderr.write(message.rstrip("\n") + "\n")
        self.stderr.flush()

    def failure(self, f: Failure) -> int:
        self.stderr.write(f"leasehold: {f.message}\n" + "".join(f"  - {d}\n" for d in f.details))
        self.stderr.flush()
        if self.json:
            error = {"exit": int(f.code), "kind": f.code.name.lower().replace("_", "-"), "message": f.message}
            if f.details:
                error["details"] = f.details
            self.stdout.write(json.dumps({"error": error, **f.data}, indent=2) + "\n")
            self.stdout.flush()
        return int(f.code)


def out(args: argparse.Namespace) -> Output:
    """The :class:`Output` a command's parsed arguments ask for."""
    return Output(getattr(args, "output", None) or "text")


def add_output_option(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-o/--output text|json``. On the top-level parser (``top=True``) it sets the default; on
    a subcommand it overrides it only when given (``leasehold -o json status`` and ``leasehold
    status -o json`` both work)."""
    parser.add_argument("-o", "--output", choices=FORMATS, default="text" if top else argparse.SUPPRESS,
                        help="text for people (default) or one JSON document for scripts")


def run(handler: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command: its return value is the exit code; a :class:`Failure` becomes the stderr
    line, the JSON error document and its code; Ctrl-C exits 130; anything else is reported in
    one line (exit 70) — with the traceback only when ``LEASEHOLD_DEBUG`` is set."""
    o = out(args)
    try:
        return int(handler(args) or 0)
    except Failure as f:
        return o.failure(f)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the one place an unexpected error becomes a message
        if os.environ.get("LEASEHOLD_DEBUG"):
            traceback.print_exc()
        return o.failure(Failure(Exit.INTERNAL, f"unexpected error: {type(e).__name__}: {e}"))


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a command's output file whole or not at all: the bytes go to a temporary file in the
    same directory, are flushed to disk, and replace ``path`` in one rename (a symlink's target is
    replaced; an existing file keeps its mode). A failure (no such directory, a directory in the way,
    a full disk) leaves ``path`` as it was and raises :class:`Failure` (exit 2) naming it. A path
    that is not a regular file (``/dev/stdout``, a pipe) is written to directly."""
    import stat
    import tempfile

    target = os.path.realpath(path)
    tmp = None
    try:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        else:
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
            if not stat.S_ISREG(st.st_mode):
                with open(path, "wb") as stream:
                    stream.write(data)
                return
            mode = st.st_mode & 0o7777
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target) or ".", prefix=f".{os.path.basename(target)}.",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise Failure(Exit.USAGE, f"cannot write {os.fspath(path)}: {e.strerror or e}; nothing was written") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def exit_code_epilog() -> str:
    """The exit code table for ``--help`` (plain text)."""
    return "exit codes:\n" + "\n".join(f"  {int(c):>2}  {m.replace('`', '')}" for c, m in MEANINGS.items())


def exit_code_table() -> str:
    """The exit code table for ``docs/cli.md`` (Markdown)."""
    rows = [f"| {int(c)} | `{c.name}` | {m} |" for c, m in MEANINGS.items()]
    return "\n".join(["| code | name | meaning |", "|---|---|---|", *rows]) + "\n"


__all__ = ["Exit", "FORMATS", "Failure", "MEANINGS", "Output", "add_output_option", "exit_code_epilog",
           "exit_code_table", "out", "run", "write_file"]
