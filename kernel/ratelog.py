"""Rate-limited log lines for events that can repeat at request rate (an attacker's refused
requests, a dependency that flaps). Pure: the clock is passed in.

* :class:`KeyedLog` — at most one line per key per interval; the next line says how many
  were not written.
* :class:`TransitionLog` — one line per change of a condition (e.g. Redis reachable ->
  unreachable), at most one per interval: changes in between are counted, and the state the
  condition is in when the interval has passed is written with that count on the next
  observation, so a flapping dependency costs a few lines, and the last line is always the
  current state.
* :class:`ThrottleFilter` — the same for a library's logger (a ``logging.Filter``): at most one
  record per logger and message template per interval, cut to ``max_chars``; the next one
  written says how many were not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

from .caches import BoundedMemo


class KeyedLog:
    def __init__(self, logger: logging.Logger, *, interval_s: float = 1.0, max_keys: int = 1_000,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        self._last: BoundedMemo[Hashable, tuple[float, int]] = BoundedMemo(max_keys)  # throttling state only

    def log(self, key: Hashable, level: int, message: str) -> bool:
        """Write ``message`` unless a line for ``key`` was written less than an interval ago;
        returns whether it was written."""
        now = self.clock()
        last, suppressed = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[key] = (last, suppressed + 1)
            return False
        self._last.put(key, (now, 0))
        more = f" (+{suppressed} more since the last line)" if suppressed else ""
        self.logger.log(level, "%s%s", message, more)
        return True


class ThrottleFilter(logging.Filter):
    def __init__(self, *, interval_s: float = 10.0, max_chars: int = 240, max_keys: int = 1_000,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self.max_chars = max_chars
        self.clock = clock
        self._last: BoundedMemo[Hashable, tuple[float, int]] = BoundedMemo(max_keys)

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg).__name__)
        now = self.clock()
        last, suppressed = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[key] = (last, suppressed + 1)
            return False
        self._last.put(key, (now, 0))
        message = record.getMessage()
        if len(message) > self.max_chars:
            message = message[:self.max_chars] + "..."
        if suppressed:
            message += f" (+{suppressed} more since the last line)"
        record.msg, record.args = message, None
        return True


class TransitionLog:
    def __init__(self, logger: logging.Logger, *, initial: Hashable, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.current = initial  # the condition's state as last observed
        self.logged = initial  # the state the last line (or the start) reported
        self.last_at = float("-inf")
        self.changes = 0  # changes observed since the last line

    def observe(self, state: Hashable, line: Callable[[Hashable, int], tuple[int, str]]) -> bool:
        """Record the condition's current ``state``; ``line(state, changes)`` gives (level, message)
        when a line is due. Returns whether a line was written."""
        if state != self.current:
            self.current = state
            self.changes += 1
        if state == self.logged:
            return False
        now = self.clock()
        if now - self.last_at < self.interval_s:
            return False
        level, message = line(state, self.changes)
        self.logger.log(level, "%s", message)
        self.logged, self.last_at, self.changes = state, now, 0
        return True
