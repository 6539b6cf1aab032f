"""Rate-limited log lines for events that can repeat at request rate (an attacker's refused
requests, a dependency that flaps). The clock is passed in.

* :class:`KeyedLog` — at most one line per key per interval; the next line says how many
  were not written. When a line was held back and none follows, the last one held back is
  written with that count once the interval is over (a timer on the running event loop), so
  the end of a flood is counted too.
* :class:`TransitionLog` — one line per change of a condition (e.g. Redis reachable ->
  unreachable), at most one per interval: changes in between are counted, and the state the
  condition is in when the interval has passed is written with that count on the next
  observation, so a flapping dependency costs a few lines, and the last line is always the
  current state.
* :class:`ThrottleFilter` — the same for a library's logger (a ``logging.Filter``): at most one
  record per logger and message template per interval, cut to ``max_chars``; the next one
  written says how many were not (and the last one held back is written as above).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

from .caches import BoundedMemo


def _call_later(delay_s: float, fn: Callable[..., object], *args: object) -> bool:
    """``fn(*args)`` after ``delay_s`` on the running event loop (False when none runs)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    loop.call_later(max(0.0, delay_s), fn, *args)
    return True


class KeyedLog:
    def __init__(self, logger: logging.Logger, *, interval_s: float = 1.0, max_keys: int = 1_000,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.clock = clock
        # throttling state only: key -> [last line at, not written since, the last of those (level, message), flush due]
        self._last: BoundedMemo[Hashable, list[Any]] = BoundedMemo(max_keys)

    def log(self, key: Hashable, level: int, message: str) -> bool:
        """Write ``message`` unless a line for ``key`` was written less than an interval ago;
        returns whether it was written."""
        now = self.clock()
        st = self._last.get(key)
        if st is not None and now - st[0] < self.interval_s:
            st[1] += 1
            st[2] = (level, message)
            if not st[3]:
                st[3] = _call_later(st[0] + self.interval_s - now, self.flush, key)
            return False
        suppressed = st[1] if st is not None else 0
        self._last.put(key, [now, 0, None, False])
        more = f" (+{suppressed} more since the last line)" if suppressed else ""
        self.logger.log(level, "%s%s", message, more)
        return True

    def flush(self, key: Hashable) -> bool:
        """Once ``key``'s interval is over: the last line not written, with the count of the others
        (scheduled by :meth:`log` on the running event loop, so a flood's last lines are counted
        even when no line for its key follows). Returns whether a line was written."""
        st = self._last.get(key)
        if st is None or not st[1]:
            return False
        st[3] = False
        level, message = st[2]
        more = f" (+{st[1] - 1} more since the last line)" if st[1] > 1 else ""
        self._last.put(key, [self.clock(), 0, None, False])
        self.logger.log(level, "%s%s", message, more)
        return True


class ThrottleFilter(logging.Filter):
    def __init__(self, *, interval_s: float = 10.0, max_chars: int = 240, max_keys: int = 1_000,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval_s = interval_s
        self.max_chars = max_chars
        self.clock = clock
        # (logger, template) -> [last record at, not written since, the last of those, flush due]
        self._last: BoundedMemo[Hashable, list[Any]] = BoundedMemo(max_keys)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_leasehold_throttled", False):  # written by flush: already counted
            return True
        key = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg).__name__)
        now = self.clock()
        st = self._last.get(key)
        if st is not None and now - st[0] < self.interval_s:
            st[1] += 1
            st[2] = record
            if not st[3]:
                st[3] = _call_later(st[0] + self.interval_s - now, self.flush, key)
            return False
        suppressed = st[1] if st is not None else 0
        self._last.put(key, [now, 0, None, False])
        self._shape(record, suppressed)
        return True

    def flush(self, key: Hashable) -> bool:
        """The last record not written once its interval is over, with the count of the others
        (as :meth:`KeyedLog.flush`)."""
        st = self._last.get(key)
        if st is None or not st[1]:
            return False
        st[3] = False
        record = st[2]
        self._shape(record, st[1] - 1)
        self._last.put(key, [self.clock(), 0, None, False])
        record._leasehold_throttled = True
        logging.getLogger(record.name).handle(record)
        return True

    def _shape(self, record: logging.LogRecord, suppressed: int) -> None:
        message = record.getMessage()
        if len(message) > self.max_chars:
            message = message[:self.max_chars] + "..."
        if suppressed:
            message += f" (+{suppressed} more since the last line)"
        record.msg, record.args = message, None


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
