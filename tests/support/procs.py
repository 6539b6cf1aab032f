"""Whether a process a test started is still there (after a stop that should have ended it)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """A process with that PID exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
