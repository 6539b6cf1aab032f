"""HTTP client for the allocator's lease API.

Retries (tenacity) only errors that say they are retriable, always with the *same*
``leaseId`` — the allocator answers a repeated id from its stored record, so a lost reply
never doubles a grant. A follower's ``not-leader`` answer names the leader, and the next
attempt goes there. Every call has a per-attempt timeout and a total deadline.

A sharded allocator (pools spread over shards of leadership, each led by some replica) is
learned from its not-leader answers and ``GET /v1/shards`` (``routing.ShardRoutes``): each
pool's calls then go to its shard's leader, and :meth:`AllocatorClient.report_many` splits a
batch of usage reports by leader. Against an unsharded allocator nothing of this is used.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
import msgspec
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from kernel import tracing
from kernel.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    LeaseholdError,
    NotFound,
    NotLeader,
    StoreUnavailable,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    is_retriable,
)
from kernel.wire import (
    MAX_BATCH,
    LeaseError,
    LeaseGrant,
    LeaseRequest,
    ShardMap,
    UsageBatchRequest,
    UsageReceipt,
    UsageReport,
)

from .routing import ShardRoutes

T = TypeVar("T")
REFRESH_MIN_INTERVAL_MS = 250.0  # GET /v1/shards at most this often
USAGE_BATCH_RETRY_MS = 300_000.0  # after a 404 for POST /v1/usage/batch, single reports this long
REFRESH_GRACE_S = 0.05  # after the first map arrives, how long the others may still answer before we go on
_JSON = {"content-type": "application/json"}
_BY_STATUS: dict[int, type[LeaseholdError]] = {
    400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 422: ValidationFailed,
}


class AllocatorClient:
    def __init__(self, urls: Sequence[str], *, token: str | None = None, attempt_timeout_s: float = 0.5,
                 deadline_s: float = 3.0, max_attempts: int = 6, transport: httpx.AsyncBaseTransport | None = None):
        if not urls:
            raise ValueError("at least one allocator URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._preferred = 0
        self.deadline_s = deadline_s
        self.max_attempts = max_attempts
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(timeout=attempt_timeout_s, headers=headers, transport=transport,
                                       limits=httpx.Limits(max_connections=16))
        self.attempt_timeout_s = attempt_timeout_s
        self.last_rtt_ms: float = 50.0
        self.routes = ShardRoutes(self.urls)
        self._refreshing: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")
        self._background: set[asyncio.Task[Any]] = set()
        self._no_usage_batch_until = float("-inf")  # monotonic ms: an allocator answered 404 to /v1/usage/batch

    async def aclose(self) -> None:
        for t in [*self._background, *([self._refreshing] if self._refreshing else [])]:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.aclose()

    async def lease(self, req: LeaseRequest) -> LeaseGrant:
        return await self._call("POST", "/v1/leases", msgspec.json.encode(req), LeaseGrant, req.pool)

    async def report(self, report: UsageReport) -> UsageReceipt:
        return await self._call("POST", f"/v1/leases/{report.lease_id}/usage", msgspec.json.encode(report),
                                UsageReceipt, report.pool)

    async def report_many(self, reports: Sequence[UsageReport]) -> list[UsageReceipt | LeaseError]:
        """Usage reports of many leases: one ``POST /v1/usage/batch`` per shard leader (a batch
        spanning shards is split, the parts sent concurrently), results in request order. Items
        answered with a retriable error (not-leader during a handoff, fenced, unavailable) are
        retried after re-routing, within the client's attempts and deadline. An allocator without that route
        (404: an older version during a rolling upgrade) gets the reports one at a time."""
        return await self._many(reports, self._usage_once)

    async def _many(self, reqs: Sequence[Any], send: Any) -> list[Any]:
        results: dict[int, Any] = {}
        todo = list(range(len(reqs)))
        deadline = _now() + self.deadline_s * 1000.0
        for attempt in range(self.max_attempts):
            if self.routes.stale:
                await self.refresh_map()
            groups = self.routes.split([reqs[i].pool for i in todo], self.urls[self._preferred])
            parts = [(url, [todo[j] for j in idx[k:k + MAX_BATCH]])
                     for url, idx in groups.items() for k in range(0, len(idx), MAX_BATCH)]
            outcomes = await asyncio.gather(*(send(url, [reqs[i] for i in ids]) for url, ids in parts),
                                            return_exceptions=True)
            retry: list[int] = []
            follower = False  # the preferred URL answered items not-leader (unsharded: try the next)
            for (url, ids), out in zip(parts, outcomes, strict=True):
                if isinstance(out, BaseException):
                    if not isinstance(out, LeaseholdError):
                        raise out
                    for i in ids:
                        results[i] = LeaseError(lease_id=reqs[i].lease_id, status=out.status, code=out.code,
                                                detail=out.detail)
                    if out.retriable:
                        retry += ids
                    continue
                for i, item in zip(ids, out, strict=True):
                    results[i] = item
                    if isinstance(item, LeaseError) and item.status >= 500:
                        retry.append(i)
                        if item.code in ("not-leader", "fenced") and self.routes.sharded:
                            self.routes.stale = True  # batch items carry no leader: ask the map
                        elif item.code == "not-leader" and url == self.urls[self._preferred]:
                            follower = True
            if follower:  # a batch answered per item names no leader: as a not-leader answer naming none
                self._rotate()
            todo = sorted(retry)
            if not todo or _now() >= deadline or attempt == self.max_attempts - 1:
                break
            await asyncio.sleep(min(0.5, 0.05 * 2 ** attempt) * (0.5 + 0.5 * (attempt % 2)))
        return [results[i] for i in range(len(reqs))]

    async def refresh_map(self) -> None:
        """Ask every configured URL for ``GET /v1/shards`` (at most every 250 ms; one refresh at a
        time). Returns once a map arrived and the others had 50 ms more, or after the attempt
        timeout; later answers are still learned in the background."""
        if self._refreshing is not None and not self._refreshing.done():
            await asyncio.wait({self._refreshing}, timeout=self.attempt_timeout_s)
            return
        if _now() - self._last_refresh < REFRESH_MIN_INTERVAL_MS:
            return
        self._last_refresh = _now()
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        await asyncio.wait({self._refreshing}, timeout=self.attempt_timeout_s + REFRESH_GRACE_S)

    async def _refresh(self) -> None:
        fetches = [asyncio.get_running_loop().create_task(self._fetch_map(u)) for u in self.urls]
        for t in fetches:
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        pending: set[asyncio.Task[bool]] = set(fetches)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(t.result() for t in done):
                break
        if pending:
            await asyncio.wait(pending, timeout=REFRESH_GRACE_S)

    async def _fetch_map(self, url: str) -> bool:
        """One replica's map (a background probe: any failure is just no answer)."""
        try:
            resp = await self._http.get(url + "/v1/shards")
            if resp.status_code != 200:
                return False
            self.routes.learn_map(url, msgspec.json.decode(resp.content, type=ShardMap))
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - httpx can raise more than HTTPError on a torn connection
            return False

    async def _call(self, method: str, path: str, body: bytes, typ: type[T], pool: str | None = None) -> T:
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.deadline_s) | stop_after_attempt(self.max_attempts),
            wait=wait_random_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception(is_retriable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._once(method, path, body, typ, pool)
        raise AssertionError("unreachable")  # pragma: no cover

    def _target(self, pool: str | None) -> str:
        return (self.routes.url_for(pool) if pool is not None else None) or self.urls[self._preferred]

    async def _usage_once(self, url: str, reports: list[UsageReport]) -> list[UsageReceipt | LeaseError]:
        if _now() >= self._no_usage_batch_until:
            body = msgspec.json.encode(UsageBatchRequest(reports=reports))
            try:
                raw = await self._send(url, "POST", "/v1/usage/batch", body)
            except NotFound:  # an allocator from before the batch route: one at a time (asked again later)
                self._no_usage_batch_until = _now() + USAGE_BATCH_RETRY_MS
            else:
                return self._items(url, raw, len(reports), "granted", UsageReceipt)
        out: list[UsageReceipt | LeaseError] = []
        for r in reports:
            try:
                out.append(await self._once("POST", f"/v1/leases/{r.lease_id}/usage", msgspec.json.encode(r),
                                            UsageReceipt, r.pool))
            except LeaseholdError as e:
                out.append(LeaseError(lease_id=r.lease_id, status=e.status, code=e.code, detail=e.detail))
        return out

    def _items(self, url: str, raw: bytes, n: int, marker: str, typ: type[Any]) -> list[Any]:
        """A batch answer's ``results``: ``typ`` where ``marker`` is present, else ``LeaseError``."""
        try:
            items = msgspec.json.decode(raw)["results"]
            out = [msgspec.convert(it, typ if marker in it else LeaseError) for it in items]
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError):
            raise Unavailable(f"allocator {url} sent an unreadable batch answer") from None
        if len(out) != n:
            raise Unavailable(f"allocator {url} answered {len(out)} results for {n} requests")
        return out

    async def _once(self, method: str, path: str, body: bytes, typ: type[T], pool: str | None = None) -> T:
        if self.routes.stale:
            await self.refresh_map()
        url = self._target(pool)
        try:
            content = await self._send(url, method, path, body)
        except NotLeader:
            if pool is None or not self.routes.sharded:
                raise
            if self.routes.stale:
                await self.refresh_map()
            follow = self._target(pool)
            if follow == url:
                raise
            # the answer named the pool's shard leader: follow it now (a redirect, not a retry)
            url, content = follow, await self._send(follow, method, path, body)
        try:
            return msgspec.json.decode(content, type=typ)
        except msgspec.DecodeError:
            raise Unavailable(f"allocator {url} sent an unreadable answer") from None

    async def _send(self, url: str, method: str, path: str, body: bytes) -> bytes:
        """One attempt; the body of a 200 answer, or the typed error of any other outcome. With
        tracing on: a ``leasehold.lease_request`` span whose context goes to the allocator."""
        if not tracing.ENABLED:
            return await self._attempt(url, method, path, body, _JSON)
        with tracing.span("leasehold.lease_request", kind=tracing.SpanKind.CLIENT,
                          attributes={"http.request.method": method, "url.path": path, "server.address": url}):
            return await self._attempt(url, method, path, body, tracing.inject(dict(_JSON)))

    async def _attempt(self, url: str, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        loop_time = _now()
        try:
            resp = await self._http.request(method, url + path, content=body, headers=headers)
        except httpx.ConnectError as e:
            self._unreachable(url)
            raise StoreUnavailable(f"allocator {url} unreachable: {type(e).__name__}") from None
        except httpx.TimeoutException as e:
            self._unreachable(url)
            raise Unavailable(f"allocator {url} timed out: {type(e).__name__}") from None
        except httpx.HTTPError as e:
            self._unreachable(url)
            raise Unavailable(f"allocator {url} failed: {type(e).__name__}") from None
        self.last_rtt_ms = 0.8 * self.last_rtt_ms + 0.2 * (_now() - loop_time)
        if resp.status_code == 200:
            return resp.content
        problem = _problem(resp)
        detail = str(problem.get("detail") or resp.reason_phrase)
        if problem.get("type", "").endswith("/fenced") and self.routes.sharded:
            self.routes.stale = True  # the shard moved while our request was in flight
        if problem.get("type", "").endswith("/not-leader"):
            self.routes.learn_not_leader(problem)
            leader = problem.get("leader")
            if isinstance(leader, str) and leader.rstrip("/") in self.urls:
                self._preferred = self.urls.index(leader.rstrip("/"))
            else:
                self._rotate()
            raise NotLeader(detail, extra={"leader": leader})
        if resp.status_code >= 500:
            self._rotate()
            raise Unavailable(f"allocator answered {resp.status_code}: {detail}")
        raise _BY_STATUS.get(resp.status_code, BadRequest)(detail, extra={"status": resp.status_code})

    def _rotate(self) -> None:
        self._preferred = (self._preferred + 1) % len(self.urls)

    def _unreachable(self, url: str) -> None:
        self.routes.forget_url(url)
        if not self.routes.sharded or url == self.urls[self._preferred]:  # unsharded: as it always did
            self._rotate()


def _problem(resp: httpx.Response) -> dict:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _now() -> float:
    return time.monotonic() * 1000.0
