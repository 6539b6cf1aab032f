"""Helpers for the script tests: reading script state back from Redis as model states,
simulating a sleep by moving stored timestamps back, and bracketing calls with the local clock
(Redis TIME and time.time() read the same machine clock); and the parts the differential tests
share (the rule sets, pool grants, one bracketed step matched against a model)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, settings
from redis.exceptions import NoScriptError

from kernel.algorithms.concurrency import ConcurrencyState
from kernel.algorithms.fixed_window import FixedWindowState
from kernel.algorithms.gcra import GcraState
from kernel.algorithms.multi_rule import RuleSpec
from kernel.algorithms.pool import PoolEntry, PoolState
from kernel.algorithms.pool_window import PoolWindowState
from kernel.algorithms.sliding_counter import SlidingCounterState
from kernel.algorithms.sliding_log import SlidingLogState
from kernel.algorithms.token_bucket import TokenBucketState
from region_agent.decision.call import (
    MultiRuleResult,
    PoolRefund,
    PoolTake,
    parse_multi_rule,
    parse_pool_refund,
    parse_pool_take,
    pool_refund_call,
    pool_take_call,
)
from region_agent.store.scripts import Scripts


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
    whose slots have all expired also counts as no key (its PEXPIRE is max score - now, so Redis
    deletes it exactly then)."""
    if state is None:
        return None
    if kind in ("sl", "cc"):
        d = dict(state.entries if kind == "sl" else state.slots)
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
  redis.call('ZADD', KEYS[1], 'XX', tonumber(z[i + 1]) - tonumber(ARGV[1]), z[i])
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
    elif kind in ("sl", "cc"):  # in one script: a key with a few ms left must not expire half-way and
        r.eval(_SHIFT_ZSET, 1, key, d)  # come back without an expiry (ZADD XX never creates one)
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
        return ConcurrencyState({m: s - d for m, s in state.slots.items()})
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


# --- the differential tests' shared parts -------------------------------------------------------
SLACK = 600_000  # long enough that no key expires in real time during an example
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SCRIPTS = Scripts()


def evalsha(r, name, keys, argv):
    """EVALSHA ``name``; a lean variant first named here (``multi_rule[fw,tb]``) is loaded on its NOSCRIPT."""
    sha = SCRIPTS.sha(name)
    try:
        return r.evalsha(sha, len(keys), *keys, *argv)
    except NoScriptError:
        r.script_load(SCRIPTS.source(name))
        return r.evalsha(sha, len(keys), *keys, *argv)


def tag() -> str:
    return "{t:" + uuid.uuid4().hex[:12] + "}"


def step(call, model, read_states, prev_states, kinds, reply_of=lambda d: d.as_reply()):
    """One bracketed call. ``model(now) -> (decision, new_states | None)``; returns the matched
    now and the model's states after it."""
    reply, t0, t1 = bracketed(call)
    read = read_states()
    t_read = now_ms()  # a key whose expiry passed before it was read back is gone (short TTLs, a busy machine)
    tried = []
    for n in range(t0, t1 + 1):
        d, new = model(n)
        states = prev_states if new is None else new
        got = [norm(k, s, max(n, t_read)) for k, s in zip(kinds, read, strict=True)]
        want = [norm(k, s, max(n, t_read)) for k, s in zip(kinds, states, strict=True)]
        if reply_of(d) == as_ints(reply) and want == got:
            return n, list(states)
        tried.append((reply_of(d), want))
    raise AssertionError(f"script {as_ints(reply)} / {got} matches no model instant in [{t0}, {t1}]: {tried}")


def make_rule(kind: str, cost: int, *, tokens_ms: int = 5_000, count: int = 6, log: int = 5) -> RuleSpec:
    """A rule of ``kind`` charging ``cost``: buckets of ``tokens_ms`` millitokens (1/s), windows of
    ``count`` units a minute, logs of ``log`` entries in 3 s; the gates and pool windows fixed."""
    return {
        "tb": RuleSpec("tb", (tokens_ms, 1_000, 1_000, cost * 1_000, 0)),
        "gcra": RuleSpec("gcra", (tokens_ms, 1_000, 1_000, cost * 1_000, 0)),
        "fw": RuleSpec("fw", (count, 60_000, cost, 0, 0)),
        "sc": RuleSpec("sc", (count, 60_000, cost, 0, 0)),
        "sl": RuleSpec("sl", (log, 3_000, cost, 0, 0)),
        "cc": RuleSpec("cc", (3, 2_000, 0, 0, 0)),
        "pool": RuleSpec("pool", (cost, 0, 0, 0, 0)),
        "pw": RuleSpec("pw", (5, 1_000 + cost % 2, 1_001 + cost % 2, cost, 600_000)),
    }[kind]


def deposit_grants(r: Any, key: str, grants: Sequence[tuple[int, int, int]]) -> PoolState | None:
    """``pool_deposit`` each (granted, valid-from offset, lifetime in ms) as lease ``G<i>``, from
    now; the model's pool state after them (checked against what the script stored)."""
    base = now_ms()
    entries = {}
    for g, (granted, from_off, life) in enumerate(grants):
        lid = f"G{g}"
        res = evalsha(r, "pool_deposit", [key], [lid, granted, base + from_off, base + from_off + life, 8, SLACK])
        assert as_ints(res[:1]) == [1]
        entries[lid] = PoolEntry(granted, 0, base + from_off, base + from_off + life)
    state = PoolState(entries) if entries else None
    assert norm("pool", read_state(r, "pool", key)) == norm("pool", state)
    return state


def shift_rules(r: Any, kinds: Sequence[str], keys: Sequence[str], states: Sequence[Any], d: int) -> list:
    """A sleep of ``d`` ms for every rule of a set, in Redis and in the model: the model's states."""
    for k, key in zip(kinds, keys, strict=True):
        shift_back(r, k, key, d)
    return [shift_model(k, s, d) for k, s in zip(kinds, states, strict=True)]


def read_rules(r: Any, kinds: Sequence[str], keys: Sequence[str]) -> list:
    """Every rule's state of a set, read back as model states."""
    return [read_state(r, k, key) for k, key in zip(kinds, keys, strict=True)]


# --- typed calls of the single-rule scripts (the agent itself only runs multi_rule and pool_*) ---
@dataclass(frozen=True, slots=True)
class RateResult:
    """Reply of the single-rule rate scripts (token bucket, GCRA, windows, log)."""

    allowed: bool
    remaining: int  # millitokens for tb/gcra, units/entries for fw/sc/sl
    retry_after_ms: int  # -1 = never


@dataclass(frozen=True, slots=True)
class SlotResult:
    """Reply of the concurrency scripts: ok = acquired / released / renewed."""

    ok: bool
    in_flight: int


def _rate(reply: Any) -> RateResult:
    return RateResult(bool(int(reply[0])), int(reply[1]), int(reply[2]))


def _slot(reply: Any) -> SlotResult:
    return SlotResult(bool(int(reply[0])), int(reply[1]))


class ScriptCalls(Scripts):
    """The agent's script registry with a typed wrapper per script."""

    async def multi_rule(self, client: Any, keys: Sequence[str], argv: Sequence[Any]) -> MultiRuleResult:
        return parse_multi_rule(await self.call(client, "multi_rule", keys, argv))

    async def token_bucket(self, client: Any, key: str, *, capacity: int, refill: int, period_ms: int,
                           cost: int, slack_ms: int) -> RateResult:
        """Millitokens and ms."""
        return _rate(await self.call(client, "token_bucket", [key], [capacity, refill, period_ms, cost, slack_ms]))

    async def gcra(self, client: Any, key: str, *, capacity: int, refill: int, period_ms: int, cost: int,
                   slack_ms: int) -> RateResult:
        """Same units as the token bucket; remaining in millitokens."""
        return _rate(await self.call(client, "gcra", [key], [capacity, refill, period_ms, cost, slack_ms]))

    async def fixed_window(self, client: Any, key: str, *, limit: int, window_ms: int, cost: int = 1,
                           slack_ms: int = 0) -> RateResult:
        return _rate(await self.call(client, "fixed_window", [key], [limit, window_ms, cost, slack_ms]))

    async def sliding_counter(self, client: Any, key: str, *, limit: int, window_ms: int, cost: int = 1,
                              slack_ms: int = 0) -> RateResult:
        return _rate(await self.call(client, "sliding_counter", [key], [limit, window_ms, cost, slack_ms]))

    async def sliding_log(self, client: Any, key: str, *, limit: int, window_ms: int, member: str,
                          cost: int = 1, slack_ms: int = 0) -> RateResult:
        return _rate(await self.call(client, "sliding_log", [key], [limit, window_ms, member, cost, slack_ms]))

    async def concurrency_acquire(self, client: Any, key: str, slot_id: str, *, max_in_flight: int,
                                  slot_ttl_ms: int) -> SlotResult:
        return _slot(await self.call(client, "concurrency_acquire", [key], [slot_id, max_in_flight, slot_ttl_ms]))

    async def concurrency_release(self, client: Any, key: str, slot_id: str) -> SlotResult:
        return _slot(await self.call(client, "concurrency_release", [key], [slot_id]))

    async def concurrency_renew(self, client: Any, key: str, slot_id: str, *, slot_ttl_ms: int) -> SlotResult:
        return _slot(await self.call(client, "concurrency_renew", [key], [slot_id, slot_ttl_ms]))

    async def pool_take(self, client: Any, key: str, *, min_tokens: int, want: int, slack_ms: int,
                        per_s: int = 0, waiting: int = 0) -> PoolTake:
        return parse_pool_take(await self.call(client, *pool_take_call(key, min_tokens=min_tokens, want=want,
                                                                          slack_ms=slack_ms, per_s=per_s,
                                                                          waiting=waiting)))

    async def pool_refund(self, client: Any, key: str, record_key: str, *, tokens: int, slack_ms: int,
                          debits: Sequence[tuple[str, int]]) -> PoolRefund:
        return parse_pool_refund(await self.call(client, *pool_refund_call(key, record_key, tokens=tokens,
                                                                              slack_ms=slack_ms, debits=debits)))
