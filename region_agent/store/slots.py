"""Which Redis Cluster primary owns which hash slot: the agent's own slot map.

Pure: built from a node's ``CLUSTER SLOTS`` reply (:meth:`SlotMap.from_cluster_slots`), patched
by a ``MOVED`` reply (:meth:`SlotMap.moved`), compared with a fresh read to tell a topology
change (:meth:`SlotMap.same`). A primary is named ``host:port`` — the name its breaker, its
metrics and its store-health series carry (region_agent.store.cluster).

A key's slot is CRC16 of its hash tag modulo 16384 (``redis.crc.key_slot``, the function
redis-py's own cluster client uses); every key of one script call shares the tenant's tag
``{t:<tenant>}``, so one call has one slot and one owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.crc import key_slot

SLOTS = 16_384


def node_name(host: str, port: int | str) -> str:
    return f"{host}:{int(port)}"


def split_name(name: str) -> tuple[str, int]:
    host, port = name.rsplit(":", 1)
    return host, int(port)


def slot_of(key: str | bytes) -> int:
    """The hash slot of ``key`` (its ``{tag}`` when it has one)."""
    return key_slot(key if isinstance(key, bytes) else key.encode())


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class SlotMap:
    """slot -> owning primary (``None``: no primary known for it)."""

    __slots__ = ("_owner", "replicas")

    def __init__(self, ranges: Iterable[tuple[int, int, str]] = (), replicas: dict[str, tuple[str, ...]] | None = None):
        self._owner: list[str | None] = [None] * SLOTS
        for first, last, name in ranges:
            if not 0 <= first <= last < SLOTS:
                raise ValueError(f"slot range {first}-{last} outside 0-{SLOTS - 1}")
            self._owner[first:last + 1] = [name] * (last - first + 1)
        self.replicas: dict[str, tuple[str, ...]] = dict(replicas or {})  # primary -> its replicas (as reported)

    @classmethod
    def from_cluster_slots(cls, reply: Sequence[Any], answered_by: str) -> SlotMap:
        """From ``CLUSTER SLOTS`` (``[[first, last, [host, port, id, ...], [replica...]...], ...]``)
        as read from the node ``answered_by`` (``host:port``): an empty host means that node's
        host (Redis' "unknown endpoint"), as the protocol says."""
        default_host = split_name(answered_by)[0]
        ranges: list[tuple[int, int, str]] = []
        replicas: dict[str, tuple[str, ...]] = {}

        def name_of(node: Sequence[Any]) -> str:
            host = _text(node[0]) or default_host
            return node_name(host, _text(node[1]))

        for entry in reply:
            if len(entry) < 3:
                raise ValueError("CLUSTER SLOTS entry without a primary")
            primary = name_of(entry[2])
            ranges.append((int(entry[0]), int(entry[1]), primary))
            replicas[primary] = tuple(dict.fromkeys(replicas.get(primary, ()) + tuple(name_of(r) for r in entry[3:])))
        return cls(ranges, replicas)

    @property
    def owners(self) -> list[str | None]:
        """The owner of every slot, indexed by slot (read only: the router's hot path)."""
        return self._owner

    def owner(self, slot: int) -> str | None:
        return self._owner[slot]

    def owner_of(self, key: str | bytes) -> str | None:
        return self._owner[slot_of(key)]

    def moved(self, slot: int, name: str) -> bool:
        """A ``MOVED slot host:port`` reply: the slot is now ``name``'s. True when that changed the map."""
        if self._owner[slot] == name:
            return False
        self._owner[slot] = name
        return True

    def primaries(self) -> list[str]:
        """Every primary owning at least one slot, in slot order."""
        return list(dict.fromkeys(n for n in self._owner if n is not None))

    def slot_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self._owner:
            if n is not None:
                out[n] = out.get(n, 0) + 1
        return out

    def uncovered(self) -> int:
        """Slots no primary is known to own."""
        return sum(1 for n in self._owner if n is None)

    def same(self, other: SlotMap) -> bool:
        return self._owner == other._owner

    def nodes(self) -> list[str]:
        """Primaries and their replicas (where to ask for the topology)."""
        out = self.primaries()
        for p in list(out):
            out += [r for r in self.replicas.get(p, ()) if r not in out]
        return out
