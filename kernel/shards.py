"""Which shard of allocator leadership a pool belongs to (shared by the allocator and the agents).

A sharded allocator deployment splits its pools over a fixed number of shards; each shard has
its own leader and epoch (see ``allocator/shards.py``). Both sides must map a pool to the same
shard, so the hash is stable across processes, machines and Python versions (BLAKE2b of the
pool id, never Python's randomised ``hash``)::

    shard_of(pool, n) = int.from_bytes(blake2b(pool_id as UTF-8, digest_size=8), "big") mod n

``n == 1`` (the default deployment: one leader for every pool) maps every pool to shard 0.
"""

from __future__ import annotations

from functools import lru_cache
from hashlib import blake2b

SHARD_HASH = "blake2b64-mod"  # named in GET /v1/shards so a client can tell it computes the same map
MAX_SHARDS = 1024


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that every process computes alike."""
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=65_536)
def shard_of(pool_id: str, shards: int) -> int:
    """The shard (0 .. shards-1) that leads ``pool_id``."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be in [1, {MAX_SHARDS}], not {shards}")
    return 0 if shards == 1 else stable_hash64(pool_id) % shards
