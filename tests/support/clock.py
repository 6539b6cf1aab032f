"""A clock the test moves by hand."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.monotonic`` (or a milliseconds clock: the unit is the caller's):
    returns ``t``, which only the test changes (``clock.t = …`` or :meth:`advance`)."""

    __slots__ = ("t",)

    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t
