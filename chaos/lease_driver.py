"""A region's lease traffic against the real allocator, recorded in the history.

:class:`LeaseDriver` plays one region's lease manager for one pool: it mints lease ids, asks
the allocator replicas (``POST /v1/leases``, following "not the leader" answers to the next
URL), spends every token it was granted while the lease is valid and records each grant and
each spend. It also injects *message faults*: duplicated and delayed requests that reuse a
lease id (the allocator must answer with the same grant), and refuses grants whose epoch is
older than one it already accepted (invariant 4, region side). Every loop is bounded in
requests and time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

from kernel.wire import LeaseGrant

from .history import DecisionRec, Grant, HistoryWriter, PoolSpend, grant_from_wire, now_ms

MAX_REQUESTS = 100_000


@dataclass
class DriverStats:
    requests: int = 0
    grants: int = 0
    tokens: int = 0
    denials: int = 0
    errors: int = 0
    replays: int = 0
    replay_mismatches: int = 0
    stale_refused: int = 0


@dataclass
class LeaseDriver:
    region: str
    pool: str
    urls: Sequence[str]  # allocator replicas, each reached through this region's own link/proxy
    history: HistoryWriter
    want: int = 10
    interval_s: float = 0.05
    replay_probability: float = 0.0  # duplicate a request (same lease id) after a delay
    replay_delay_ms: tuple[int, int] = (0, 300)
    timeout_s: float = 1.0
    seed: int = 0
    run_id: str = "run"
    token: str | None = None  # the region's bearer token for the allocator, when auth is on
    stats: DriverStats = field(default_factory=DriverStats)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("LeaseDriver needs at least one allocator URL")
        self._rng = random.Random(f"{self.seed}-{self.region}-{self.pool}")
        self._url = 0
        self._max_epoch = 0
        self._n = 0
        self._accepted: list[tuple[dict, Grant]] = []  # (request, grant) of accepted grants, bounded
        self._stopped = False

    def stop(self) -> None:
        """End :meth:`run` after the request in flight (and the pending replays)."""
        self._stopped = True

    @property
    def newest_epoch(self) -> int:
        """The newest leader epoch an allocator's answer carried so far (0: none yet)."""
        return self._max_epoch

    def _lease_id(self) -> str:
        self._n += 1
        return f"{self.run_id}.{self.region}.{self.pool}.{self._n:06d}"

    async def run(self, duration_s: float, max_requests: int = 10_000) -> DriverStats:
        max_requests = min(max_requests, MAX_REQUESTS)
        deadline = time.monotonic() + duration_s
        replays: list[asyncio.Task] = []
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers) as client:
            while time.monotonic() < deadline and self.stats.requests < max_requests and not self._stopped:
                lease_id = self._lease_id()
                body = {"leaseId": lease_id, "region": self.region, "pool": self.pool, "want": self.want}
                grant = await self._ask(client, body, source="region")
                if grant is not None and self.replay_probability and self._rng.random() < self.replay_probability:
                    delay = self._rng.uniform(*self.replay_delay_ms) / 1000.0
                    replays.append(asyncio.create_task(self._replay(client, body, grant, delay)))
                await asyncio.sleep(self.interval_s)
            if replays:
                await asyncio.wait(replays, timeout=self.timeout_s * len(self.urls) + 1.0)
            for t in replays:
                t.cancel()
        return self.stats

    async def _post(self, client: httpx.AsyncClient, body: dict) -> tuple[LeaseGrant | None, int, int]:
        """One request, trying each replica at most once. (grant, sent_ms, received_ms)."""
        sent = now_ms()
        for _ in range(len(self.urls)):
            url = self.urls[self._url % len(self.urls)]
            self.stats.requests += 1
            try:
                r = await client.post(f"{url}/v1/leases", json=body)
            except httpx.HTTPError:
                self.stats.errors += 1
                self._url += 1
                continue
            if r.status_code == 200:
                return msgspec.json.decode(r.content, type=LeaseGrant), sent, now_ms()
            self.stats.errors += 1
            if r.status_code in (503, 409, 421):  # not the leader / fenced: try the next replica
                self._url += 1
                continue
            break  # a 4xx is a bug in this driver: stop asking for this lease
        return None, sent, now_ms()

    async def _ask(self, client: httpx.AsyncClient, body: dict, source: str) -> Grant | None:
        wire, sent, received = await self._post(client, body)
        if wire is None:
            return None
        accepted = wire.epoch >= self._max_epoch
        if not accepted:
            self.stats.stale_refused += 1
        self._max_epoch = max(self._max_epoch, wire.epoch)
        rec = grant_from_wire(wire, sent_at_ms=sent, received_at_ms=received, source=source, accepted=accepted)
        self.history.write(rec)
        if source == "region" and accepted:
            self._spend(rec)
            if wire.granted > 0:
                self._accepted = [*self._accepted[-255:], (body, rec)]
        return rec

    async def replay_stale(self, count: int = 5) -> int:
        """Message fault: re-send the requests of up to ``count`` granted leases whose epoch is
        older than the newest this region accepted (after a failover). The allocator answers
        each with the stored grant (same lease id, old epoch); the region must refuse it.
        Returns how many were answered."""
        old = [(b, g) for b, g in self._accepted if g.epoch < self._max_epoch][-count:]
        answered = 0
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers) as client:
            for body, first in old:
                again = await self._ask(client, body, source="replay")
                if again is None:
                    continue
                answered += 1
                self.stats.replays += 1
                if (again.granted, again.window_index, again.epoch) != (first.granted, first.window_index, first.epoch):
                    self.stats.replay_mismatches += 1
        return answered

    def _spend(self, g: Grant) -> None:
        now = now_ms()
        if g.granted == 0:
            self.stats.denials += 1
            self.history.write(DecisionRec(agent=f"driver-{self.region}", region=self.region, tenant="driver",
                                        allowed=False, recorded_at_ms=now, reason="pool_exhausted",
                                        spends=[PoolSpend(pool=g.pool, tokens=self.want,
                                                          window_index=g.window_index)]))
            return
        if g.starts_in_ms > 0 or g.sent_at_ms is None or now >= g.sent_at_ms + g.ttl_ms:
            return  # not spendable now (prefetched or already expired on our clock)
        self.stats.grants += 1
        self.stats.tokens += g.granted
        self.history.write(DecisionRec(agent=f"driver-{self.region}", region=self.region, tenant="driver",
                                    allowed=True, recorded_at_ms=now,
                                    spends=[PoolSpend(pool=g.pool, tokens=g.granted, lease_id=g.lease_id,
                                                      window_index=g.window_index)]))

    async def _replay(self, client: httpx.AsyncClient, body: dict, first: Grant, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        again = await self._ask(client, body, source="replay")
        if again is None:
            return
        self.stats.replays += 1
        if (again.granted, again.window_index, again.epoch) != (first.granted, first.window_index, first.epoch):
            self.stats.replay_mismatches += 1
