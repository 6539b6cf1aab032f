"""Where this process stands on the allocator's clock, and so in which pool window — pure, the
clocks are passed in (this process's monotonic ms, and its wall clock ms).

The allocator numbers the windows of a pool on its leader's wall clock: window ``k`` of a pool
with ``windowMs`` W covers allocator time ``[k·W, (k+1)·W)``. Every fallback allowance of the
overshoot bound is counted per window *as the allocator defines it* (DESIGN invariant 6), so an
agent must place its own decisions on that clock — not on Redis TIME, not on its monotonic clock.

A grant carries ``issuedAtMs`` (the leader's clock when it decided). The request was sent at
``s`` and the answer received at ``r`` on this process's monotonic clock, and the leader decided
in between, so ``issuedAt - r <= allocator - monotonic <= issuedAt - s``: an interval as wide
as the round trip. The latest grant's interval is used (a new leader may run another clock),
widened with its age by :data:`MAX_DRIFT` (clock rates differ). Before any grant this host's wall
clock stands in, give or take ``unknown_offset_ms``.

A decision at monotonic ``t`` then lies in one of the windows
``floor((t + lo) / W) .. floor((t + hi) / W)`` — one, or two near a boundary. Charging an
allowance to *every* candidate keeps each allocator window's count within the allowance, whichever
window the decision really fell in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

MAX_DRIFT = 0.001  # 1,000 ppm between this host's monotonic clock and the allocator's wall clock
DEFAULT_UNKNOWN_OFFSET_MS = 1_000.0


class Windows(NamedTuple):
    """Allocator windows a decision may fall in, and when the last of them ends."""

    lo: int
    hi: int
    end_in_ms: int  # from now until window ``hi`` has ended on every admissible allocator clock
    safe_ms: int  # from now, how long the allocator's clock surely stays within window ``hi``

    @property
    def span(self) -> int:
        return self.hi - self.lo + 1


@dataclass
class AllocatorClock:
    unknown_offset_ms: float = DEFAULT_UNKNOWN_OFFSET_MS
    lo: float | None = None  # bounds on (allocator ms - monotonic ms) at ``at``
    hi: float | None = None
    at: float = 0.0  # monotonic ms of the observation

    def observe(self, sent_mono_ms: float, received_mono_ms: float, issued_at_ms: int) -> None:
        """A grant answered (not a replay: a replay carries the original ``issuedAtMs``)."""
        if received_mono_ms < sent_mono_ms:
            return
        self.lo = issued_at_ms - received_mono_ms
        self.hi = issued_at_ms - sent_mono_ms
        self.at = received_mono_ms

    @property
    def known(self) -> bool:
        return self.lo is not None

    def bounds(self, mono_ms: float, wall_ms: float) -> tuple[float, float]:
        """Earliest and latest allocator time it may be now."""
        if self.lo is None or self.hi is None:
            return wall_ms - self.unknown_offset_ms, wall_ms + self.unknown_offset_ms
        widen = MAX_DRIFT * max(0.0, mono_ms - self.at)
        return mono_ms + self.lo - widen, mono_ms + self.hi + widen

    def windows(self, window_ms: int, mono_ms: float, wall_ms: float) -> Windows:
        earliest, latest = self.bounds(mono_ms, wall_ms)
        lo, hi = int(earliest // window_ms), int(latest // window_ms)
        end = (hi + 1) * window_ms
        return Windows(lo, hi, max(1, int(end - earliest + 0.999)), max(0, int(end - latest)))
