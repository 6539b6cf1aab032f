"""Pool balances in the regional Redis, over the ``pool_*`` scripts."""

from __future__ import annotations

import time
from typing import Any

from region_agent.store.scripts import PoolClosed, Scripts

# how long a balance hash outlives its last lease: the agent closes a lease (pool_close) after its
# deadline, on a later tick, and must still find its record (else it is reported lost, fully spent)
BALANCE_SLACK_MS = 5_000


class RedisBalanceStore:
    def __init__(self, client: Any, scripts: Scripts, *, max_entries: int = 16, slack_ms: int = BALANCE_SLACK_MS):
        self.client = client
        self.scripts = scripts
        self.max_entries = max_entries
        self.slack_ms = slack_ms

    async def observe(self, key: str) -> tuple[int, float, float]:
        """Spendable tokens and bounds on (Redis clock - monotonic clock) for the key's node:
        the script read TIME somewhere between our send and our receipt."""
        sent = time.monotonic() * 1000.0
        bal = await self.scripts.pool_balance(self.client, key)
        received = time.monotonic() * 1000.0
        return bal.spendable(), bal.now_ms - received, bal.now_ms - sent

    async def deposit(self, key: str, lease_id: str, granted: int, valid_from_ms: int, expires_at_ms: int) -> bool:
        r = await self.scripts.pool_deposit(self.client, key, lease_id, granted=granted, valid_from_ms=valid_from_ms,
                                            expires_at_ms=expires_at_ms, max_entries=self.max_entries,
                                            slack_ms=self.slack_ms)
        return r.stored

    async def close(self, key: str, lease_id: str) -> PoolClosed | None:
        return await self.scripts.pool_close(self.client, key, lease_id)
