"""The version of Leasehold, written in one place (this module; ``pyproject.toml`` reads it), and
the build commit, shown by ``--version`` on every entry point and exported by both services as
``leasehold_build_info{version,commit} 1`` (:mod:`kernel.build_info`;
docs/decisions/0001-version-and-build-info.md).

The commit is the ``LEASEHOLD_BUILD_COMMIT`` environment variable (the container image sets it
from its build argument), else the checkout's ``git rev-parse HEAD`` when the package runs from
a git work tree (``make run``, the tests), else ``unknown`` (a wheel installed elsewhere).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

__version__ = "0.2.0"

COMMIT_ENV = "LEASEHOLD_BUILD_COMMIT"
_COMMIT_RE = re.compile(r"[0-9a-f]{7,40}\Z")


@functools.cache
def build_commit() -> str:
    """The commit this code was built from: 12 hex digits, or ``unknown``."""
    raw = os.environ.get(COMMIT_ENV, "").strip().lower()
    if _COMMIT_RE.match(raw):
        return raw[:12]
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / ".git").exists():  # a directory, or a worktree's file
        return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[:12] if _COMMIT_RE.match(out) else "unknown"


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints: ``PROG 0.2.0 (commit 9ed22a8c1f3e)``."""
    return f"{prog} {__version__} (commit {build_commit()})"


__all__ = ["COMMIT_ENV", "__version__", "build_commit", "version_line"]
