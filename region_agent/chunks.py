"""In-process chunk leases for fleet-wide (global-scope) pools, seed ch. 12 ``leasedAdmit``.

Pure state: the clock (monotonic ms) is passed in. A chunk is bought from the pool's
``{g:<pool>}`` balance with one store call (``pool_take.lua``: valid no longer than the leases
it came from, so never past their window), spent locally, and abandoned (never refunded) when
its validity ends. A reservation taken for a request whose tenant script then denies is given
back to the same chunk, in-process only.

The negative cache of a chunk is by cost: a renewal that could not pay ``cost`` denies locally
requests of at least that cost until ``deny_until_ms``; cheaper requests are not blocked by it
(one expensive request must not deny the cheap ones the pool can still serve).
"""

from __future__ import annotations

from dataclasses import dataclass

NO_CHUNK = -1  # generation of tokens bought for one request only (never given back to the chunk)


@dataclass(slots=True)
class ChunkLease:
    remaining: int = 0
    expires_at_ms: float = 0.0
    deny_until_ms: float = 0.0
    deny_min_cost: int = 1  # the local denial applies to requests of at least this cost
    generation: int = 0  # bumps on every grant so a late give-back cannot land in a newer chunk
    fallback: bool = False  # this chunk came from the pool's fallback allowance (allocator unreachable)

    def valid(self, now_ms: float) -> bool:
        return now_ms < self.expires_at_ms

    def usable(self, now_ms: float) -> int:
        """Tokens a request can take right now."""
        return self.remaining if self.valid(now_ms) else 0

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

    def negative(self, now_ms: float, cost: int = 1) -> bool:
        return now_ms < self.deny_until_ms and cost >= self.deny_min_cost

    def grant(self, tokens: int, now_ms: float, validity_ms: int, *, fallback: bool = False) -> None:
        """A renewal succeeded: the old chunk's leftovers are abandoned."""
        self.generation += 1
        self.fallback = fallback
        self.remaining = tokens
        self.expires_at_ms = now_ms + validity_ms
        self.deny_until_ms = 0.0
        self.deny_min_cost = 1

    def deny(self, now_ms: float, retry_after_ms: int, validity_ms: int, min_cost: int = 1) -> int:
        """A renewal could not pay ``min_cost``: deny requests of at least that cost locally for
        min(hint, validity); returns that wait. The chunk's own leftovers stay spendable."""
        wait = validity_ms if retry_after_ms < 0 else min(max(retry_after_ms, 1), validity_ms)
        self.deny_until_ms = now_ms + wait
        self.deny_min_cost = min_cost
        return wait
