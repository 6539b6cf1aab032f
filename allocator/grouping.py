"""Pure: how the committer groups queued writes into etcd transactions ("units").

A unit is one transaction's worth of grants, or of usage reports, that the committer sends while
up to ``free`` other units are in flight. The rules, each an invariant the unit tests check:

* **pools are exclusive**: a pool is in at most one unit at a time — neither in two units formed
  together nor in a unit while another one that touches it is still in flight (``busy``). The
  committer updates a window's state in place when it decides, so two transactions on one
  window at once would both start from one state (and only one could commit: each compares
  the window's ``mod_revision``);
* **queue order per pool**: an item that has to wait (its pool is busy, its unit is full) holds
  back every later item of its pool, so a pool's items are decided in the order they came;
* **one epoch per shard and unit**: a transaction compares each shard's epoch once; items of a
  shard accepted under another epoch (this replica lost and won the shard again) wait for a
  later unit;
* **etcd's limits**: per branch at most ``max_ops`` ops (etcd's ``--max-txn-ops``) — a grant
  needs one compare and one put, plus one compare and one put per window and one compare per
  shard; a usage report is counted as two of each (its window is known only after its grant
  record is read) — and at most ``max_bytes`` of estimated request size (etcd's
  ``--max-request-bytes``);
* **one report per lease and unit** (a second report of a lease waits, then replays the first).

``per_unit`` caps the items of a unit: the committer spreads what is queued over the free
slots so Python builds the next transaction while etcd commits one, and transactions grow up to
etcd's limit when the queue is long.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

RECORD_BYTES = 700  # estimated bytes of one grant or report in a transaction (record, key twice)
WINDOW_BYTES = 900  # estimated bytes of a window record and its key, until one was encoded


class Queued(Protocol):
    pool: str
    shard: int
    epoch: int
    is_grant: bool

    @property
    def window_choice(self) -> str: ...

    @property
    def lease_id(self) -> str: ...


Q = TypeVar("Q", bound=Queued)


class Unit(Generic[Q]):
    """Items of one kind bound for one transaction, with what they cost of etcd's limits."""

    __slots__ = ("is_grant", "items", "fence", "pools", "windows", "compares", "puts", "bytes", "lease_ids")

    def __init__(self, is_grant: bool):
        self.is_grant = is_grant
        self.items: list[Q] = []
        self.fence: dict[int, int] = {}  # shard -> epoch
        self.pools: set[str] = set()
        self.windows: set[tuple[str, str]] = set()
        self.lease_ids: set[str] = set()
        self.compares = self.puts = self.bytes = 0

    def cost(self, item: Queued, window_bytes: Callable[[str], int]) -> tuple[int, int, int]:
        """(compares, puts, bytes) this unit grows by with ``item``."""
        shard_new = 0 if item.shard in self.fence else 1
        if self.is_grant:
            if (item.pool, item.window_choice) in self.windows:
                return shard_new + 1, 1, RECORD_BYTES
            return shard_new + 2, 2, RECORD_BYTES + window_bytes(item.pool)
        return shard_new + 2, 2, RECORD_BYTES + window_bytes(item.pool)

    def add(self, item: Q, cost: tuple[int, int, int]) -> None:
        self.items.append(item)
        self.fence[item.shard] = item.epoch
        self.pools.add(item.pool)
        if self.is_grant:
            self.windows.add((item.pool, item.window_choice))
        else:
            self.lease_ids.add(item.lease_id)
        self.compares += cost[0]
        self.puts += cost[1]
        self.bytes += cost[2]


def form_units(ready: Iterable[Q], *, busy: set[str] | frozenset[str], free: int, per_unit: int,
               max_ops: int, max_bytes: int, window_bytes: Callable[[str], int] = lambda _p: WINDOW_BYTES,
               ) -> tuple[list[Unit[Q]], list[Q]]:
    """Group ``ready`` (queue order) into at most ``free`` units; returns (units, items left for
    later, in queue order)."""
    units: list[Unit[Q]] = []
    left: list[Q] = []
    held: set[str] = set(busy)  # pools whose (remaining) items wait
    unit_of: dict[str, Unit[Q]] = {}  # pool -> its unit in this pass
    full = 0  # units holding per_unit items
    items = iter(ready)
    for item in items:
        if full >= free:  # every slot taken by a full unit: the rest waits, in order (a long queue)
            left.append(item)
            left.extend(items)
            break
        pool = item.pool
        if pool in held:
            left.append(item)
            continue
        unit = unit_of.get(pool)
        if unit is not None:
            cost = _fits(unit, item, window_bytes, per_unit, max_ops, max_bytes)
            if cost is None:
                held.add(pool)
                left.append(item)
                continue
        else:  # a pool new to this pass: the first unit it fits in (few: at most ``free``), or a new one
            for unit in units:
                cost = _fits(unit, item, window_bytes, per_unit, max_ops, max_bytes)
                if cost is not None:
                    break
            else:
                if len(units) >= free:
                    held.add(pool)
                    left.append(item)
                    continue
                unit = Unit(item.is_grant)
                units.append(unit)
                cost = unit.cost(item, window_bytes)
            unit_of[pool] = unit
        unit.add(item, cost)
        if len(unit.items) == per_unit:
            full += 1
    return units, left


def _fits(unit: Unit[Q], item: Q, window_bytes: Callable[[str], int], per_unit: int, max_ops: int,
          max_bytes: int) -> tuple[int, int, int] | None:
    """What ``unit`` grows by with ``item``, or None when the item may not join it."""
    is_grant = unit.is_grant
    if is_grant != item.is_grant or len(unit.items) >= per_unit:
        return None
    epoch = unit.fence.get(item.shard)
    if epoch is not None and epoch != item.epoch:
        return None
    if not is_grant and item.lease_id in unit.lease_ids:
        return None
    cost = unit.cost(item, window_bytes)
    if unit.compares + cost[0] <= max_ops and unit.puts + cost[1] <= max_ops and unit.bytes + cost[2] <= max_bytes:
        return cost
    return None
