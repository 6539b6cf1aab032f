"""Approximate local counters for coarse protective rules (a rule's ``approximate`` field).

An approximate rule is not sent to Redis per request. Each agent process counts what it admits
per key and window in process and, every ``reconcileMs``, adds its local delta to the key's
count in Redis and reads the global count back (``lua/approx_reconcile.lua``: one script per key,
HINCRBY of the delta per window index, then the counts of the current and previous window and
the store's clock). It decides with the algorithm's own reference model over
``count Redis had at the last reconciliation + what this agent admitted since``.

**Which algorithms.** ``fixed_window`` and ``sliding_counter`` only: their state is a count per
window, and counts are sums, so deltas from several agents add up in any order. A token bucket or
GCRA state is a level and a timestamp (two agents' partial spends do not add), and a sliding log
is a set of timestamps; validation refuses ``approximate`` on them.

**The bound.** Each agent keeps at most ``localMax`` units per key that Redis has not seen
(admitted since its last reconciliation, or sent and not confirmed). Every agent admits only while
``last count read + own unseen + cost <= limit``. Take the agent whose last reading before it
admitted was the latest of all: everything the others had flushed by then is in that reading, what
the others admitted afterwards is their unseen part (at most ``localMax`` each), and its own
admissions after it are at most ``limit - reading``. So per key and window::

    counted in the window <= limit + (agents - 1) x localMax

where ``agents`` are agent *processes* (``--workers N`` counts N; a restarted process counts once
more: its unseen units are lost, never flushed). The same holds with Redis unreachable for some or
all agents: a cut-off agent still never has more than ``localMax`` unseen, so it admits at most
``localMax`` per window beyond its last reading, and all of them together at most ``agents x
localMax <= limit + (agents - 1) x localMax`` (validation keeps ``localMax <= limit``). As a rate:
one agent over-admits at most ``localMax`` per reconciliation interval, so ``localMax`` should be
about the agent's expected rate on the key times ``reconcileMs``: smaller tightens the bound, but a
busy agent whose unseen count reaches ``localMax`` denies until its next reconciliation (it
reconciles early when it reaches half of it).

What it does not cover: a sliding counter's estimate is approximate by construction (it weighs the
previous window as if spread evenly); the bound is on the window counts it estimates from. Windows
are on the store's clock as each agent estimates it (offset learned from every reconciliation's
reply, error at most half a round trip). A failed or ambiguous reconciliation is sent again: a
delta the store did apply is then counted twice — over-counting, which only denies earlier.

A key dropped from a full table (``MAX_KEYS`` per process, least recently used first) loses its
unseen units, at most ``localMax``: counted like one more process. A split tenant's sub-buckets
(kernel/split.py) divide ``localMax`` with the limit, so their terms add up to the rule's.

Pure: no I/O; the caller passes the clock (``now_ms``: store-clock milliseconds).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .algorithms.fixed_window import FixedWindowState, WindowParams
from .algorithms.fixed_window import decide as fw_decide
from .algorithms.sliding_counter import SlidingCounterState
from .algorithms.sliding_counter import decide as sc_decide

if TYPE_CHECKING:
    from .algorithms.rule import RuleBase as Rule

APPROXIMATE_ALGORITHMS = ("fixed_window", "sliding_counter")
MAX_KEYS = 100_000  # keys counted per agent process (least recently used dropped: its unseen units too)


def approximate_problems(rule: Rule) -> list[str]:
    """What is wrong with ``rule``'s ``approximate`` field (nothing when it has none)."""
    a = rule.approximate
    if a is None:
        return []
    p: list[str] = []
    if rule.algorithm not in APPROXIMATE_ALGORITHMS:
        p.append(f"approximate applies to fixed_window and sliding_counter rules only, not {rule.algorithm} "
                 "(their state is a count per window, and counts from several agents add up)")
        return p
    limit = getattr(rule, "limit", None) or 0
    window_ms = getattr(rule, "window_ms", None) or 0
    if a.local_max > limit:
        p.append(f"approximate localMax {a.local_max} exceeds the limit {limit}")
    if window_ms and a.reconcile_ms >= window_ms:
        p.append(f"approximate reconcileMs {a.reconcile_ms} must be shorter than windowMs {window_ms}")
    if rule.fail_mode != "local_bounded":
        p.append("an approximate rule answers from its local counter whether Redis answers or not: "
                 "failMode must be local_bounded")
    if rule.fallback is not None:
        p.append("fallback does not apply to an approximate rule (its local counter, within localMax, is its "
                 "allowance while Redis is unreachable)")
    if rule.concurrency_max is not None:
        p.append("an approximate rule carries no concurrency gate")
    if rule.shadow:
        p.append("a shadow rule cannot be approximate")
    if rule.exempt:
        p.append("an exempt rule (a capped bypass) cannot be approximate: its cap must be exact")
    if rule.scope == "global" or rule.pool_id is not None:
        p.append("a pool cannot be approximate")
    return p


class ApproxBound(NamedTuple):
    rule: str
    limit: int
    window_ms: int
    local_max: int
    reconcile_ms: int
    agents: int
    total: int  # the most one key's window can count

    @property
    def excess(self) -> int:
        return self.total - self.limit

    @property
    def formula(self) -> str:
        return (f"{self.limit:,} + ({self.agents} agent process(es) - 1) x localMax {self.local_max:,} = "
                f"{self.total:,} per key and {self.window_ms} ms window (reconciled every {self.reconcile_ms} ms)")


def approximate_bound(rule: Rule, agents: int) -> ApproxBound:
    """The most one key of approximate ``rule`` can count in one window with ``agents`` agent
    processes counting it (see the module doc)."""
    a = rule.approximate
    assert a is not None
    limit = getattr(rule, "limit", 0) or 0
    return ApproxBound(rule.id, limit, getattr(rule, "window_ms", 0) or 0, a.local_max, a.reconcile_ms, agents,
                       limit + max(0, agents - 1) * a.local_max)


# ------------------------------------------------------------------------------ the counters
class Take(NamedTuple):
    allowed: bool
    remaining: int
    retry_ms: int
    ticket: tuple[str, int, int] | None  # (key, window index, cost) to give back on a later denial
    local_cap: bool = False  # denied because this agent's unseen count reached localMax


@dataclass(slots=True)
class KeyCount:
    """One key's counts as this agent knows them."""

    sliding: bool
    limit: int
    window_ms: int
    local_max: int
    reconcile_ms: int
    seen_idx: int = -1  # the window index of the last reading (-1: never read)
    seen_cur: int = 0  # the count Redis had for seen_idx (this agent's flushed units included)
    seen_prev: int = 0  # and for seen_idx - 1
    pending: dict[int, int] = field(default_factory=dict)  # window index -> units admitted, not sent
    inflight: dict[int, int] = field(default_factory=dict)  # sent, not confirmed
    due_ms: float = 0.0  # next reconciliation (store clock)
    last_take_ms: float = 0.0  # the last request asked (store clock)

    def known(self, idx: int) -> int:
        if idx == self.seen_idx:
            return self.seen_cur
        if idx == self.seen_idx - 1:
            return self.seen_prev
        return 0

    def unseen(self, idx: int) -> int:
        return self.pending.get(idx, 0) + self.inflight.get(idx, 0)

    def total(self, idx: int) -> int:
        return self.known(idx) + self.unseen(idx)

    def forget_old(self, idx: int) -> None:
        """Drop unseen units of windows no decision reads any more (before idx - 1)."""
        for d in (self.pending, self.inflight):
            for w in [w for w in d if w < idx - 1]:
                del d[w]

    def unseen_all(self) -> int:
        return sum(self.pending.values()) + sum(self.inflight.values())


class Reconcile(NamedTuple):
    """One key's reconciliation to send: its window and the deltas per window index."""

    key: str
    window_ms: int
    deltas: tuple[tuple[int, int], ...]


class ApproxCounters:
    """Every approximate key of one agent process."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.keys: OrderedDict[str, KeyCount] = OrderedDict()
        self.urgent: set[str] = set()  # keys past half their localMax: reconcile now

    def _count(self, key: str, rule: Rule, now_ms: float) -> KeyCount:
        kc = self.keys.get(key)
        a = rule.approximate
        assert a is not None
        limit, window_ms = getattr(rule, "limit", 0) or 0, getattr(rule, "window_ms", 0) or 0
        if kc is None or (kc.limit, kc.window_ms, kc.local_max, kc.reconcile_ms) != (
                limit, window_ms, a.local_max, a.reconcile_ms):
            if kc is None and len(self.keys) >= self.max_keys:
                self.keys.popitem(last=False)
            fresh = KeyCount(rule.algorithm == "sliding_counter", limit, window_ms, a.local_max, a.reconcile_ms,
                             due_ms=now_ms + a.reconcile_ms)
            if kc is not None:  # a policy change: what is unseen stays to be flushed
                fresh.pending, fresh.inflight = kc.pending, kc.inflight
                fresh.seen_idx, fresh.seen_cur, fresh.seen_prev = kc.seen_idx, kc.seen_cur, kc.seen_prev
            kc = self.keys[key] = fresh
        else:
            self.keys.move_to_end(key)
        return kc

    def take(self, key: str, rule: Rule, cost: int, now_ms: float) -> Take:
        """Count ``cost`` units on ``key`` now if the rule admits them (the reference model over
        the last reading plus this agent's unseen units) and this agent's unseen units stay
        within ``localMax``."""
        kc = self._count(key, rule, now_ms)
        kc.last_take_ms = now_ms
        now = int(now_ms)
        w = kc.window_ms
        idx = now // w
        kc.forget_old(idx)
        params = WindowParams(kc.limit, w, cost)
        if kc.sliding:
            verdict, _ = sc_decide(SlidingCounterState(idx * w, kc.total(idx), kc.total(idx - 1)), params, now)
        else:
            verdict, _ = fw_decide(FixedWindowState(idx * w, kc.total(idx)), params, now)
        if not verdict.allowed:
            return Take(False, verdict.remaining, verdict.retry_after_ms, None)
        if kc.unseen_all() + cost > kc.local_max:
            self.urgent.add(key)
            return Take(False, verdict.remaining, max(1, int(kc.due_ms - now_ms)), None, local_cap=True)
        kc.pending[idx] = kc.pending.get(idx, 0) + cost
        if 2 * kc.unseen_all() >= kc.local_max:
            self.urgent.add(key)
        return Take(True, verdict.remaining, 0, (key, idx, cost))

    def give_back(self, ticket: tuple[str, int, int]) -> None:
        """The request these units were counted for was denied by another rule: not admitted."""
        key, idx, cost = ticket
        kc = self.keys.get(key)
        if kc is not None and kc.pending.get(idx, 0) >= cost:
            kc.pending[idx] -= cost
            if not kc.pending[idx]:
                del kc.pending[idx]

    def due(self, now_ms: float) -> list[Reconcile]:
        """The keys to reconcile now (due, or past half their localMax); their pending units move
        to in flight. A key asked within its last two windows is read every reconcileMs, with or
        without a delta; a key idle longer is dropped once nothing of it is unseen (no decision
        reads its old windows any more)."""
        out: list[Reconcile] = []
        idle = []
        for key, kc in self.keys.items():
            if kc.inflight or (kc.due_ms > now_ms and key not in self.urgent):
                continue
            if not kc.pending and now_ms - kc.last_take_ms > 2 * kc.window_ms:
                idle.append(key)
                continue
            kc.forget_old(int(now_ms) // kc.window_ms)
            kc.inflight, kc.pending = kc.pending, {}
            kc.due_ms = now_ms + kc.reconcile_ms
            out.append(Reconcile(key, kc.window_ms, tuple(sorted(kc.inflight.items()))))
        for key in idle:
            del self.keys[key]
        self.urgent.clear()
        return out

    def reconciled(self, key: str, store_now_ms: int, cur: int, prev: int) -> None:
        """The store applied the key's in-flight deltas and read back these counts."""
        kc = self.keys.get(key)
        if kc is None:
            return
        kc.inflight = {}
        kc.seen_idx, kc.seen_cur, kc.seen_prev = store_now_ms // kc.window_ms, cur, prev

    def failed(self, key: str) -> None:
        """The reconciliation failed or its outcome is unknown: send the deltas again (a delta
        the store did apply is then counted twice: over-counting, never under-)."""
        kc = self.keys.get(key)
        if kc is None:
            return
        for w, n in kc.inflight.items():
            kc.pending[w] = kc.pending.get(w, 0) + n
        kc.inflight = {}


class StoreClock:
    """This process's estimate of the store's clock: local milliseconds plus the offset the last
    reconciliation's reply told (its ``TIME`` against the middle of the round trip)."""

    def __init__(self) -> None:
        self.offset_ms: float | None = None

    def observe(self, sent_ms: float, received_ms: float, store_ms: int) -> None:
        self.offset_ms = store_ms - (sent_ms + received_ms) / 2

    def now(self, local_ms: float, wall_ms: float) -> float:
        """Store-clock milliseconds; the wall clock until a reply told the offset."""
        return wall_ms if self.offset_ms is None else local_ms + self.offset_ms


__all__ = ["APPROXIMATE_ALGORITHMS", "ApproxBound", "ApproxCounters", "KeyCount", "Reconcile", "StoreClock", "Take",
           "approximate_bound", "approximate_problems"]
