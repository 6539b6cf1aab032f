"""What the decision engine and the fleet-wide pools need of a store (:class:`Store`),
implemented over Redis by :class:`region_agent.store.node.RedisNode`; tests may pass any
object with these methods."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from ..decision.call import ScriptCall


class Store(Protocol):
    def submit(self, calls: list[ScriptCall], *, wait_s: float | None) -> Awaitable[list[Any]]:
        """Awaited: one reply per call, in order: the script's reply, or the contract error
        (:class:`kernel.errors.LeaseholdError`) in its place. Raises a ``LeaseholdError`` (when
        called, or when awaited) when none of the calls could be sent or answered (unreachable,
        overloaded, past ``wait_s``). A coroutine function satisfies it."""
        ...

    async def release(self, key: str, slot_id: str, *, wait_s: float | None = None) -> bool:
        """End the concurrency slot ``slot_id`` of the gate at ``key``; False when no live slot
        was freed (never taken, already released, or expired)."""
        ...

    async def renew(self, key: str, slot_id: str, ttl_ms: int, *, wait_s: float | None = None) -> bool:
        """Extend a live concurrency slot to ``ttl_ms`` from now; False when it is gone."""
        ...
