"""A Redis Cluster as one store: one :class:`RedisNode` per primary, calls routed by slot.

Every primary gets what a standalone Redis gets — its own connection pool, coalescing batcher,
circuit breaker and stall detection — so a primary that hangs or dies opens only its own breaker
and degrades only the tenants whose slots it owns; the other primaries' pipelines never wait
behind it. A decision's calls all carry the tenant's hash tag, so they go to one primary; a
batch is split into one pipeline per primary and its replies put back in order.

Routing follows the agent's own slot map (:class:`~region_agent.store.slots.SlotMap`), read
with ``CLUSTER SLOTS`` from any node that answers (primaries whose breaker is closed first,
each read bounded), and kept current three ways:

* a ``MOVED`` reply (:class:`~region_agent.store.scripts.SlotMoved`: the script did not run)
  moves that slot at once and the call is sent once more to the new owner within its budget;
  an ``ASK`` reply (a slot being migrated) sends that call once to the target after ``ASKING``;
* a primary whose breaker opens, or a slot with no known owner, makes the map re-read every
  ``fast_s`` (0.5 s) until it is whole and no breaker is open — this is how a replica promoted
  by a Cluster failover is found;
* and every ``refresh_s`` anyway (``--redis-cluster-refresh-ms``).

A primary that left the map (failed over, removed) is retired: its node is closed once its
calls in flight ended, and its breaker and store-health series disappear.

Why not redis-py's ``RedisCluster``: its nodes share one client — a connection error or timeout
on one node makes the next command of *any* node re-read the topology under a lock every
pipeline waits on, ``CLUSTERDOWN`` and every fifth ``MOVED`` close the connections of every
node (failing pipelines in flight on healthy primaries), and a pipeline answers only when its
slowest node did. Those are the couplings this module exists to remove; it still uses redis-py
for connections, the protocol and error parsing (docs/decisions, "per-shard breakers").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kernel.errors import AmbiguousOutcome, LeaseholdError, StoreUnavailable

from ..decision.call import ScriptCall
from . import scripts as sc
from .breaker import CLOSED, STATE_NAMES
from .lag import LoopLag
from .node import RedisNode
from .slots import SLOTS, SlotMap, slot_of, split_name

log = logging.getLogger(__name__)

FAST_REFRESH_S = 0.5  # re-read period while a breaker is open or a slot has no known owner
MIN_REFRESH_GAP_S = 0.1  # at most ten topology reads a second, whatever asks for them
FIRST_READ_S = 2.0  # the first read of the map (at start: new connections, maybe a busy machine) per node
RETIRE_AFTER_S = 2.0  # a retired primary's node is closed this long after it left the map

NodeFactory = Callable[[str, Callable[[bool], None]], RedisNode]  # (host:port, on_reachability) -> node
ClientFactory = Callable[[str], Any]  # host:port -> a standalone redis.asyncio.Redis (topology reads)


class ClusterStore:
    """The :class:`~region_agent.store.protocol.Store` over a Redis Cluster (see the module doc).

    ``seeds``: ``host:port`` of the nodes named in the URL; ``make_node(name, on_reachability)``
    builds a primary's node (its client, breaker and metrics); ``make_client(name)`` a small
    client for topology reads of nodes without a RedisNode (seeds, replicas);
    ``on_topology(map, changed)`` (after every read; ``changed``: it differs from a map read
    before) and ``on_retire(name)`` tell metrics about changes."""

    cluster = True

    def __init__(self, seeds: Sequence[str], make_node: NodeFactory, make_client: ClientFactory,
                 scripts: sc.Scripts, *, lag: LoopLag | None = None, refresh_s: float = 10.0,
                 fast_s: float = FAST_REFRESH_S, topology_timeout_s: float = 0.5,
                 on_topology: Callable[[SlotMap, bool], None] | None = None,
                 on_retire: Callable[[str], None] | None = None):
        if not seeds:
            raise ValueError("a cluster store needs at least one seed node")
        self.seeds = list(dict.fromkeys(seeds))
        self.make_node = make_node
        self.make_client = make_client
        self.scripts = scripts
        self.lag = lag or LoopLag()
        self.refresh_s = refresh_s
        self.fast_s = fast_s
        self.topology_timeout_s = topology_timeout_s
        self.on_topology = on_topology
        self.on_retire = on_retire
        self.map = SlotMap()
        self.nodes: dict[str, RedisNode] = {}  # primaries of the map (and MOVED targets)
        self._probes: dict[str, Any] = {}  # topology-read clients of nodes without a RedisNode
        # the last topology read that found no node: one that refused the credentials or the ACL
        # user's CLUSTER SLOTS (so the start can say so instead of "no node answered")
        self._refused: sc.StoreRefused | None = None
        self._retiring: set[asyncio.Task] = set()
        self._retired: list[RedisNode] = []  # closed by their retiring task, or by close()
        self._loading: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._wanted: asyncio.Event | None = None
        self._refresh_lock: asyncio.Lock | None = None
        self.refreshes = 0  # topology reads that succeeded
        self.changes = 0  # ... that changed the map

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop-lag monitor (shared by every primary's stall detection) and the
        topology refresher (call inside the running loop)."""
        if self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._wanted = asyncio.Event()
        self._tasks = [loop.create_task(self.lag.run(), name="loop-lag"),
                       loop.create_task(self._refresher(), name="cluster-topology")]

    async def close(self) -> None:
        for t in self._tasks + list(self._retiring) + list(self._loading):
            t.cancel()
        for t in self._tasks + list(self._retiring) + list(self._loading):
            with contextlib.suppress(BaseException):
                await t
        for node in list(self.nodes.values()) + self._retired:
            await node.close()
        self.nodes.clear()
        self._retired.clear()
        for client in self._probes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._probes.clear()

    # ------------------------------------------------------------------ topology
    def want_refresh(self) -> None:
        """Re-read the slot map soon (debounced; never waits)."""
        if self._wanted is not None:
            self._wanted.set()

    def _needs_fast_refresh(self) -> bool:
        return (not self.map.primaries() or self.map.uncovered() > 0
                or any(n.breaker.state != CLOSED for n in self.nodes.values()))

    async def _refresher(self) -> None:
        assert self._wanted is not None
        while True:
            period = self.fast_s if self._needs_fast_refresh() else self.refresh_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):  # (no inner task: cancelling the store ends this loop)
                    await self._wanted.wait()
            self._wanted.clear()
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(MIN_REFRESH_GAP_S)

    def _candidates(self) -> list[str]:
        """Whom to ask for the slot map: primaries with a closed breaker, then the other known
        nodes (primaries being probed, replicas), then the seeds."""
        healthy = [n for n in self.map.primaries() if n in self.nodes and self.nodes[n].breaker.state == CLOSED]
        return list(dict.fromkeys(healthy + self.map.nodes() + self.seeds))

    async def refresh(self, timeout_s: float | None = None) -> bool:
        """Read the slot map from the first node that answers (each read bounded by
        ``timeout_s``, default ``topology_timeout_s``) and apply it; False when no node answered."""
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:
            refused = None
            for name in self._candidates():
                try:
                    reply = await asyncio.wait_for(self._cluster_slots(name), timeout_s or self.topology_timeout_s)
                    fresh = SlotMap.from_cluster_slots(reply, name)
                except Exception as e:  # unreachable, hung, not a cluster node: ask the next one
                    log.debug("CLUSTER SLOTS from %s failed: %s", name, type(e).__name__)
                    err = sc.translate_redis_error(e, sent=False)
                    refused = err if isinstance(err, sc.StoreRefused) else refused
                    continue
                if fresh.uncovered() == SLOTS:
                    continue  # a node that knows no slots (just started, or not in the cluster yet)
                self.refreshes += 1
                self._refused = None
                self._apply(fresh)
                return True
            self._refused = refused
            return False

    async def _cluster_slots(self, name: str) -> Any:
        node = self.nodes.get(name)
        client = node.client if node is not None else self._probe(name)
        return await client.execute_command("CLUSTER", "SLOTS")

    def _probe(self, name: str) -> Any:
        client = self._probes.get(name)
        if client is None:
            client = self._probes[name] = self.make_client(name)
        return client

    def _apply(self, fresh: SlotMap) -> None:
        before = set(self.map.primaries())
        changed = bool(before) and not self.map.same(fresh)
        self.map = fresh
        now = set(fresh.primaries())
        for name in fresh.primaries():
            self._node(name)
        for name in before - now:
            self._retire(name)
        for name in [n for n in self.nodes if n not in now]:  # MOVED targets the map does not confirm
            self._retire(name)
        known = set(fresh.nodes()) | set(self.seeds)
        for name in [n for n in self._probes if n not in known]:
            client = self._probes.pop(name)
            self._background(self._retiring, client.aclose())
        if changed:
            self.changes += 1
            log.info("Redis Cluster topology changed: primaries %s (were %s), %d slots without a known owner",
                     sorted(now), sorted(before), fresh.uncovered())
        if self.on_topology is not None:
            self.on_topology(fresh, changed)

    def _node(self, name: str) -> RedisNode:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = self.make_node(name, lambda up, _n=name: self._reachability(_n, up))
            self._background(self._loading, self._load_node(node))
        return node

    def _reachability(self, name: str, reachable: bool) -> None:
        if not reachable:
            self.want_refresh()  # a failover promotes a replica: find it

    async def _load_node(self, node: RedisNode) -> None:
        """Load the scripts on a primary seen for the first time (a failure is not fatal: a call
        answered NOSCRIPT loads them then) and open its connections before its first burst."""
        with contextlib.suppress(LeaseholdError):
            await node.load()
        with contextlib.suppress(Exception):
            await node.warm(2)

    def _retire(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is None:
            return
        log.info("Redis Cluster primary %s left the slot map: its node is retired", name)
        if self.on_retire is not None:
            self.on_retire(name)

        self._retired.append(node)

        async def later() -> None:
            await asyncio.sleep(RETIRE_AFTER_S)  # its calls in flight end (or time out) first
            self._retired.remove(node)
            await node.close()

        self._background(self._retiring, later())

    def _background(self, tasks: set[asyncio.Task], coro: Awaitable[Any]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]  # callers pass coroutines; typed Awaitable for the tests' futures
        except RuntimeError:  # no loop (closing): nothing to do in the background
            if hasattr(coro, "close"):
                coro.close()
            return
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    # ------------------------------------------------------------------ the Store protocol
    def submit(self, calls: list[ScriptCall], *, wait_s: float | None) -> Awaitable[list[Any]]:
        """One reply per call, in order. Calls are grouped by the primary owning their slot; a
        group whose primary's breaker is open gets ``StoreUnavailable`` in its calls' places at once
        (nothing sent), the others are sent as usual. A single group (every decision) raises its
        node's error as a standalone store does."""
        owners = self.map.owners  # the hot path: one list index per call
        groups: dict[str | None, list[int]] = {}
        for i, call in enumerate(calls):
            keys = call[1]
            groups.setdefault(owners[slot_of(keys[0])] if keys else None, []).append(i)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        if len(groups) == 1:
            ((name, _),) = groups.items()
            return self._send(name, calls, wait_s, deadline)
        return self._send_many(groups, calls, wait_s, deadline)

    async def _send(self, name: str | None, calls: list[ScriptCall], wait_s: float | None,
                    deadline: float | None) -> list[Any]:
        if name is None and not self.map.primaries():  # no map yet (the first read failed): read it now
            remaining = FIRST_READ_S if deadline is None else deadline - time.monotonic()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.refresh(max(remaining, 0.001)), max(remaining, 0.001))
            name = self.map.owner_of(calls[0][1][0]) if calls and calls[0][1] else None
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        if name is None:
            self.want_refresh()
            raise StoreUnavailable("no Redis Cluster primary known for the key's slot")
        replies = await self._node(name).submit(calls, wait_s=wait_s)
        if sc.has_error(replies):
            await self._redirect(name, calls, replies, deadline)
        return replies

    async def _send_many(self, groups: dict[str | None, list[int]], calls: list[ScriptCall], wait_s: float | None,
                         deadline: float | None) -> list[Any]:
        out: list[Any] = [None] * len(calls)

        async def part(name: str | None, idx: list[int]) -> None:
            sub = [calls[i] for i in idx]
            try:
                got: list[Any] = await self._send(name, sub, wait_s, deadline)
            except LeaseholdError as e:
                got = [e] * len(sub)
            for i, r in zip(idx, got, strict=True):
                out[i] = r

        await asyncio.gather(*(part(name, idx) for name, idx in groups.items()))
        return out

    async def _redirect(self, name: str, calls: list[ScriptCall], replies: list[Any], deadline: float | None) -> None:
        """Follow the ``MOVED`` / ``ASK`` replies among ``replies`` once, in place (see the module doc)."""
        moved: dict[str, list[int]] = {}
        asks: list[tuple[int, str]] = []
        host = split_name(name)[0]
        for i, r in enumerate(replies):
            if r.__class__ is not sc.SlotMoved:
                continue
            target = f"{r.host or host}:{r.port}"
            if r.ask:
                asks.append((i, target))
            else:
                self._moved(r.slot, target)
                moved.setdefault(target, []).append(i)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        for target, idx in moved.items():
            try:
                again = await self._node(target).submit([calls[i] for i in idx], wait_s=remaining)
            except LeaseholdError as e:
                again = [e] * len(idx)
            for i, r in zip(idx, again, strict=True):
                replies[i] = r
        for i, target in asks:
            replies[i] = await self._ask(target, calls[i], deadline)

    async def _ask(self, target: str, call: ScriptCall, deadline: float | None) -> Any:
        node = self.nodes.get(target)
        client = node.client if node is not None else self._probe(target)
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic()) + self.topology_timeout_s
        try:
            return await asyncio.wait_for(self.scripts.run_asking(client, (call[0], list(call[1]), list(call[2]))),
                                          timeout)
        except TimeoutError:
            return AmbiguousOutcome("no reply from the slot's migration target before the deadline",
                                    extra={"cause": "timeout"})

    async def call_script(self, scripts: sc.Scripts, name: str, keys: list, argv: list) -> Any:
        """One call outside the batcher (the lease manager's balance reads and writes,
        region_agent.leasing.redis_balance): to the key's primary, one ``MOVED`` followed."""
        if not keys:
            return StoreUnavailable("a cluster call needs a key")
        for _ in range(2):
            owner = self.map.owner_of(keys[0])
            if owner is None:
                self.want_refresh()
                return StoreUnavailable("no Redis Cluster primary known for the key's slot")
            (reply,) = await scripts.run_pipeline(self._node(owner).client, [(name, keys, argv)])
            if reply.__class__ is not sc.SlotMoved:
                return reply
            if reply.ask:
                return await self._ask(f"{reply.host or split_name(owner)[0]}:{reply.port}", (name, keys, argv), None)
            self._moved(reply.slot, f"{reply.host or split_name(owner)[0]}:{reply.port}")
        return reply

    def _moved(self, slot: int, target: str) -> None:
        """A ``MOVED`` reply: the slot is ``target``'s from now on; the whole map is re-read soon."""
        if self.map.moved(slot, target):
            self.changes += 1
            if self.on_topology is not None:
                self.on_topology(self.map, True)
        self.want_refresh()

    @property
    def client(self) -> ClusterStore:
        """What a caller that runs scripts itself is given (``Scripts.call`` routes through
        :meth:`call_script`)."""
        return self

    async def release(self, key: str, slot_id: str, *, wait_s: float | None = None) -> bool:
        (reply,) = await self.submit([("concurrency_release", [key], [slot_id])], wait_s=wait_s)
        if isinstance(reply, BaseException):
            raise sc.translate_redis_error(reply, sent=True)
        return bool(int(reply[0]))

    async def renew(self, key: str, slot_id: str, ttl_ms: int, *, wait_s: float | None = None) -> bool:
        (reply,) = await self.submit([("concurrency_renew", [key], [slot_id, ttl_ms])], wait_s=wait_s)
        if isinstance(reply, BaseException):
            raise sc.translate_redis_error(reply, sent=True)
        return bool(int(reply[0]))

    # ------------------------------------------------------------------ what the app asks
    @property
    def scripts_loaded(self) -> bool:
        """The topology is known and at least one primary has the scripts (a primary that could
        not load them yet loads them at its first call: a NOSCRIPT reply reloads)."""
        return any(self.nodes[n].scripts_loaded for n in self.map.primaries() if n in self.nodes)

    async def load(self) -> None:
        """Read the topology if it is not known yet, then load the scripts on every primary;
        ``StoreUnavailable`` when no primary could be reached."""
        if not self.map.primaries() and not await self.refresh(max(FIRST_READ_S, self.topology_timeout_s)):
            raise self._refused or StoreUnavailable("no Redis Cluster node answered")
        results = await asyncio.gather(*(self._node(n).load() for n in self.map.primaries()), return_exceptions=True)
        if not any(r is None for r in results):
            refused = [r for r in results if isinstance(r, sc.StoreRefused)]
            raise refused[0] if refused else StoreUnavailable("the scripts could not be loaded on any Redis Cluster "
                                                              "primary")

    async def ping(self) -> bool:
        """True when at least one primary answers (the others' tenants are answered by their fail modes)."""
        if not self.map.primaries():
            with contextlib.suppress(Exception):
                await self.refresh()
        pings = [asyncio.ensure_future(self._node(n).ping()) for n in self.map.primaries()]
        try:
            for done in asyncio.as_completed(pings):
                if await done:
                    return True
            return False
        finally:
            for p in pings:
                p.cancel()

    async def warm(self, connections: int) -> None:
        await asyncio.gather(*(self._node(n).warm(connections) for n in self.map.primaries()))

    def info_readers(self) -> dict[str, Callable[[], Awaitable[dict[str, Any]]]]:
        """Per primary of the map, how to read its INFO (region_agent.service.store_health)."""
        return {n: self._node(n).info for n in self.map.primaries()}

    def shard_of(self, key: str) -> str:
        """The primary owning ``key`` (``unknown`` before the topology is read)."""
        return self.map.owner_of(key) or "unknown"

    async def health(self) -> list[dict[str, Any]]:
        """Per primary of the map: its slots, whether it answers a PING now (each bounded by the
        socket timeout, all at once), its breaker and whether its scripts are loaded
        (``GET /v1/health/store``)."""
        names = self.map.primaries()
        pings = await asyncio.gather(*(self._node(n).ping() for n in names))
        counts = self.map.slot_counts()
        return [{"shard": n, "slots": counts.get(n, 0), "reachable": bool(ok),
                 "breaker": STATE_NAMES[self.nodes[n].breaker.state], "scriptsLoaded": self.nodes[n].scripts_loaded}
                for n, ok in zip(names, pings, strict=True)]

    def breakers(self) -> dict[str, int]:
        """Breaker state per primary of the map."""
        return {n: self.nodes[n].breaker.state for n in self.map.primaries() if n in self.nodes}
