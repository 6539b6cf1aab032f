"""The agent's stored buckets read and written directly (the worked numbers set a bucket's tokens and
age instead of spending them, and read what a decision left): the keys of a user's and of a tenant's
rule (:func:`user_key`, :func:`tenant_key`, hashed with the tests' pepper unless told another), the store's clock."""

from __future__ import annotations

from region_agent.decision.keys import KeyBuilder
from tests.support.agent import PEPPER

FROZEN_AHEAD_MS = 3_600_000  # a bucket whose ts is ahead of the store clock gets no refill (clock-backwards clamp)


TEST_KEYS = KeyBuilder(PEPPER)


def user_key(tenant: str, user: str, route: str, *, keys: KeyBuilder = TEST_KEYS) -> str:
    """A user's bucket on a route group; ``keys`` hashes with the pepper of the agent under test."""
    return f"rl:v3:{{t:{tenant}}}:u:{keys.h(tenant, 'u', user)}:{route}"


def tenant_key(tenant: str, route: str = "all") -> str:
    return f"rl:v3:{{t:{tenant}}}:tenant:{tenant}:{route}"


async def store_now_ms(r) -> int:
    sec, usec = await r.time()
    return int(sec) * 1000 + int(usec) // 1000


async def set_bucket(r, key: str, tokens: int, *, age_ms: int | None = None) -> None:
    """Write a token bucket: frozen (no refill) when ``age_ms`` is None, else last written ``age_ms`` ago."""
    now = await store_now_ms(r)
    ts = now + FROZEN_AHEAD_MS if age_ms is None else now - age_ms
    await r.hset(key, mapping={"tokens": tokens, "ts": ts})
    await r.pexpire(key, 600_000)


async def bucket_tokens(r, key: str) -> int:
    return int(await r.hget(key, "tokens"))
