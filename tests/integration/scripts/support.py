"""Helpers for the script tests: reading script state back from Redis as model states,
simulating a sleep by moving stored timestamps back, and bracketing calls with the local clock
(Redis TIME and time.time() read the same machine clock)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from region_agent.algorithms.concurrency import ConcurrencyState
from region_agent.algorithms.fixed_window import FixedWindowState
from region_agent.algorithms.gcra import GcraState
from region_agent.algorithms.pool import PoolEntry, PoolState
from region_agent.algorithms.pool_window import PoolWindowState
from region_agent.algorithms.sliding_counter import SlidingCounterState
from region_agent.algorithms.sliding_log import SlidingLogState
from region_agent.algorithms.token_bucket import TokenBucketState


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _i(x: Any) -> int:
    return int(float(_s(x)))


def read_state(r: Any, kind: str, key: str) -> Any:
    """The key's state as the model's state type (None when the key does not exist)."""
    if kind == "tb":
        t, ts = r.hmget(key, "tokens", "ts")
        return None if t is None else TokenBucketState(_i(t), _i(ts))
    if kind == "gcra":
        v = r.get(key)
        return None if v is None else GcraState(_i(v))
    if kind == "fw":
        w, n = r.hmget(key, "w", "n")
        return None if w is None else FixedWindowState(_i(w), _i(n))
    if kind == "sc":
        w, cur, prev = r.hmget(key, "w", "cur", "prev")
        return None if w is None else SlidingCounterState(_i(w), _i(cur), _i(prev))
    if kind in ("sl", "cc"):
        z = r.zrange(key, 0, -1, withscores=True)
        if not z:
            return None
        d = {_s(m): int(s) for m, s in z}
        return SlidingLogState(d) if kind == "sl" else ConcurrencyState(d)
    if kind == "pool":
        h = r.hgetall(key)
        if not h:
            return None
        return PoolState({_s(k): PoolEntry.decode(_s(v)) for k, v in h.items()})
    if kind == "pw":
        h = {_s(k): int(_s(v)) for k, v in r.hgetall(key).items()}
        if not h:
            return None
        return PoolWindowState({int(k): n for k, n in h.items() if k != "x"}, h.get("x", 0))
    raise ValueError(kind)


def norm(kind: str, state: Any, now: int | None = None) -> Any:
    """Comparable form: empty collections are no key at all. With ``now``, a concurrency set
    whose leases have all expired also counts as no key (its PEXPIRE is max score - now, so Redis
    deletes it exactly then)."""
    if state is None:
        return None
    if kind in ("sl", "cc"):
        d = dict(state.entries if kind == "sl" else state.leases)
        if kind == "cc" and now is not None and all(s <= now for s in d.values()):
            return None
        return d or None
    if kind == "pool":  # the script's entries carry the node's incarnation, the model's ""
        return {k: replace(e, incarnation="") for k, e in state.entries.items()} or None
    if kind == "pw":  # counts only: the expiry is the store clock's
        return dict(state.counts) or None
    return state


_SHIFT_ZSET = """
local z = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #z, 2 do
  redis.call('ZADD', KEYS[1], tonumber(z[i + 1]) - tonumber(ARGV[1]), z[i])
end
return #z / 2
"""


def shift_back(r: Any, kind: str, key: str, d: int) -> None:
    """Simulate a sleep of d ms: every stored timestamp moves d ms into the past (TTL kept)."""
    if d == 0:
        return
    if kind == "tb":
        if r.exists(key):
            r.hincrby(key, "ts", -d)
    elif kind == "gcra":
        v = r.get(key)
        if v is not None:
            r.set(key, _i(v) - d, keepttl=True)
    elif kind in ("sl", "cc"):
        # atomically (a short-TTL key may expire between a read and a write here, and a ZADD would
        # then create it again without an expiry); ZADD on the existing key keeps its TTL
        r.eval(_SHIFT_ZSET, 1, key, d)
    elif kind == "pool":
        for k, v in r.hgetall(key).items():
            e = PoolEntry.decode(_s(v))
            r.hset(key, k, replace(e, valid_from_ms=e.valid_from_ms - d, expires_at_ms=e.expires_at_ms - d).encode())
    # fw / sc are aligned to absolute time: they only see real time


def shift_model(kind: str, state: Any, d: int) -> Any:
    if state is None or d == 0:
        return state
    if kind == "tb":
        return TokenBucketState(state.tokens, state.ts - d)
    if kind == "gcra":
        return GcraState(state.tat - d)
    if kind == "sl":
        return SlidingLogState({m: s - d for m, s in state.entries.items()})
    if kind == "cc":
        return ConcurrencyState({m: s - d for m, s in state.leases.items()})
    if kind == "pool":
        return PoolState({k: replace(e, valid_from_ms=e.valid_from_ms - d, expires_at_ms=e.expires_at_ms - d)
                          for k, e in state.entries.items()})
    return state


def bracketed(fn):
    t0 = now_ms()
    out = fn()
    t1 = now_ms()
    return out, t0, t1


def as_ints(reply: Any) -> list[int]:
    return [int(x) for x in reply]
