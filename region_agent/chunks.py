"""In-process chunk leases for fleet-wide (global-scope) pools, seed ch. 12 ``leasedAdmit``.

Pure state: the clock (monotonic ms) is passed in. A chunk is bought from the pool's
``{g:<pool>}`` balance with one store call, spent locally, and abandoned (never refunded)
when its validity ends. A reservation taken for a request whose tenant script then denies
is given back to the same chunk, in-process only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ChunkLease:
    remaining: int = 0
    expires_at_ms: float = 0.0
    deny_until_ms: float = 0.0
    generation: int = 0  # bumps on every grant so a late give-back cannot land in a newer chunk
    fallback: bool = False  # this chunk came from the pool's fallback allowance (allocator unreachable)

    def valid(self, now_ms: float) -> bool:
        return now_ms < self.expires_at_ms

    def try_take(self, cost: int, now_ms: float) -> int | None:
        """Spend ``cost`` tokens locally; returns the chunk generation, or None."""
        if self.remaining >= cost and self.valid(now_ms):
            self.remaining -= cost
            return self.generation
        return None

    def give_back(self, cost: int, generation: int, now_ms: float) -> bool:
        if generation == self.generation and self.valid(now_ms):
            self.remaining += cost
            return True
        return False

    def negative(self, now_ms: float) -> bool:
        return now_ms < self.deny_until_ms

    def grant(self, tokens: int, now_ms: float, validity_ms: int, *, fallback: bool = False) -> None:
        """A renewal succeeded: the old chunk's leftovers are abandoned."""
        self.generation += 1
        self.fallback = fallback
        self.remaining = tokens
        self.expires_at_ms = now_ms + validity_ms
        self.deny_until_ms = 0.0

    def deny(self, now_ms: float, retry_after_ms: int, validity_ms: int) -> int:
        """A renewal was refused: deny locally for min(hint, validity); returns that wait."""
        wait = validity_ms if retry_after_ms < 0 else min(max(retry_after_ms, 1), validity_ms)
        self.remaining = 0
        self.deny_until_ms = now_ms + wait
        return wait


def chunk_size(cost: int, chunk_min: int, chunk_max: int) -> int:
    """Tokens to ask for: the pool's chunk, at least one request's cost."""
    return max(cost, chunk_min, min(chunk_max, max(chunk_min, chunk_max)))
