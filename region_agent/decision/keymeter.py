"""New keys per second by source class ("Cardinality: is someone growing state?", docs/invariants.md I10).

The scripts do not report whether a key existed, so the agent estimates: a rate-limit key is
*new* when this agent has not touched it within the meter's horizon. Two generations of key
hashes, each ``HORIZON_S`` long: a key found in neither is counted and added to the current one;
when the current generation is older than the horizon it becomes the previous one. A key idle
for at least ``HORIZON_S`` (30 s; P-READ's key lives 15 s after its last touch) has usually
expired in Redis and is re-created by the next call, so the count approximates keys created in
the store. With several agents serving one key each counts it (an upper bound); idempotency
records are new by construction (one per idempotent request id) and counted directly.

Source classes (a bounded label): ``ip`` (pre-authentication, per client address),
``principal`` (user and key scopes), ``tenant`` (tenant and route scopes), ``pool`` (leased
balances), ``concurrency`` (concurrency gates), ``decision`` (idempotency records).

Bounded: at most ``MAX_PER_GENERATION`` hashes per generation (about 8 MB each); past that,
unseen keys are counted but not remembered (an over-count, never a growth of the agent).
Cost per decision: one or two set lookups per key, no lock (the counts are plain integers read
at scrape time); none for a remembered question's calls once every key of them is in the current
generation (``NewKeyMeter.held``, by the calls' identity: at most ``HELD_MAX``, emptied when full
and at every rotation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from kernel.algorithms import Role

HORIZON_S = 30.0
MAX_PER_GENERATION = 100_000
HELD_MAX = 20_000  # remembered questions' calls whose keys the current generation holds (emptied when full)
CLASSES = ("ip", "principal", "tenant", "pool", "concurrency", "decision")
_SCOPE_CLASS = {"ip": "ip", "user": "principal", "key": "principal", "route": "tenant", "tenant": "tenant",
                "global": "pool"}


def source_class(role: Role, scope: str) -> str:
    """The class of a script call's key from its slot role and rule scope."""
    if role is Role.CC:
        return "concurrency"
    if role is Role.POOL:
        return "pool"
    return _SCOPE_CLASS.get(scope, "tenant")


class NewKeyMeter:
    LABELS = ("source",)
    NAME = "leasehold_agent_new_keys"
    HELP = ("Rate-limit keys not touched by this agent within the last 30-60 s (about the keys the store "
            "creates), by source class")

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.cur: set[int] = set()
        self.prev: set[int] = set()
        self.since = float("-inf")
        # a remembered question's calls (the list every asking of it shares, by identity: id -> the
        # list) whose every key is in the current generation: its next askings find nothing new
        # without a lookup per key (the decision path: region_agent.decision.telemetry)
        self.held: dict[int, list[Any]] = {}

    def rotate(self, now: float) -> None:
        """The current generation becomes the previous one (every ``HORIZON_S``)."""
        self.prev, self.cur, self.since = self.cur, set(), now
        self.held = {}  # (their keys are in no current generation now)

    def seen(self, h: int, new: bool, cls: str) -> None:
        """A key hash not in the current generation: remember it (bounded), count it if ``new``."""
        if new:
            self.counts[cls] += 1
        if len(self.cur) < MAX_PER_GENERATION:
            self.cur.add(h)

    def touch(self, keys_and_classes: Iterable[tuple[str, str]], now: float) -> None:
        """``keys_and_classes``: (key, class) pairs of one decision's script calls; ``now`` in s.
        (The decision path inlines this loop: region_agent.decision.telemetry.)"""
        if now - self.since >= HORIZON_S:
            self.rotate(now)
        for key, cls in keys_and_classes:
            h = hash(key)
            if h not in self.cur:
                self.seen(h, h not in self.prev, cls)

    def count(self, cls: str, n: int = 1) -> None:
        self.counts[cls] += n

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.NAME, self.HELP, labels=list(self.LABELS))]

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(self.NAME, self.HELP, labels=list(self.LABELS))
        for cls, n in self.counts.items():
            fam.add_metric([cls], n)
        yield fam
