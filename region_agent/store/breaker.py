"""Circuit breaker for one Redis server the agent writes to (one per ``RedisNode``: the
standalone server, Sentinel's primary, or one Cluster primary): closed -> open after too many
failures in a row, open -> half-open after a cool-down, half-open lets a limited number of
probe calls through and closes on their success (reopens on a failure).

Pure: the clock is passed in (monotonic seconds). Only store failures count (unreachable,
timeouts, ambiguous outcomes); a script's own error reply is a policy fault and does not.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half_open", OPEN: "open"}


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5  # consecutive failures that open the breaker
    open_s: float = 1.0  # how long it stays open before probing
    half_open_probes: int = 2  # calls let through while half-open
    state: int = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probes_in_flight: int = 0

    def allow(self, now: float) -> bool:
        """May a call be sent now? (Counts a probe when half-open.)"""
        if self.state == OPEN:
            if now - self.opened_at < self.open_s:
                return False
            self.state, self.probes_in_flight = HALF_OPEN, 0
        if self.state == HALF_OPEN:
            if self.probes_in_flight >= self.half_open_probes:
                return False
            self.probes_in_flight += 1
        return True

    def release_probe(self) -> None:
        """A call ended without saying anything about the store (the caller's own deadline):
        give its half-open probe slot back."""
        if self.state == HALF_OPEN and self.probes_in_flight > 0:
            self.probes_in_flight -= 1

    def success(self) -> None:
        self.failures = 0
        self.probes_in_flight = 0
        self.state = CLOSED

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self.state, self.opened_at, self.probes_in_flight = OPEN, now, 0
