"""HTTP client for the allocator's lease API.

Retries (tenacity) only errors that say they are retriable, always with the *same*
``leaseId`` — the allocator answers a repeated id from its stored record, so a lost reply
never doubles a grant. A follower's ``not-leader`` answer names the leader, and the next
attempt goes there. Every call has a per-attempt timeout and a total deadline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TypeVar

import httpx
import msgspec
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

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
from kernel.wire import LeaseGrant, LeaseRequest, UsageReceipt, UsageReport

T = TypeVar("T")
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
        self.last_rtt_ms: float = 50.0

    async def aclose(self) -> None:
        await self._http.aclose()

    async def lease(self, req: LeaseRequest) -> LeaseGrant:
        return await self._call("POST", "/v1/leases", msgspec.json.encode(req), LeaseGrant)

    async def report(self, report: UsageReport) -> UsageReceipt:
        return await self._call("POST", f"/v1/leases/{report.lease_id}/usage", msgspec.json.encode(report),
                                UsageReceipt)

    async def _call(self, method: str, path: str, body: bytes, typ: type[T]) -> T:
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.deadline_s) | stop_after_attempt(self.max_attempts),
            wait=wait_random_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception(is_retriable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._once(method, path, body, typ)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(self, method: str, path: str, body: bytes, typ: type[T]) -> T:
        url = self.urls[self._preferred]
        loop_time = _now()
        try:
            resp = await self._http.request(method, url + path, content=body,
                                            headers={"content-type": "application/json"})
        except httpx.ConnectError as e:
            self._rotate()
            raise StoreUnavailable(f"allocator {url} unreachable: {type(e).__name__}") from None
        except httpx.TimeoutException as e:
            self._rotate()
            raise Unavailable(f"allocator {url} timed out: {type(e).__name__}") from None
        except httpx.HTTPError as e:
            self._rotate()
            raise Unavailable(f"allocator {url} failed: {type(e).__name__}") from None
        self.last_rtt_ms = 0.8 * self.last_rtt_ms + 0.2 * (_now() - loop_time)
        if resp.status_code == 200:
            try:
                return msgspec.json.decode(resp.content, type=typ)
            except msgspec.DecodeError:
                raise Unavailable(f"allocator {url} sent an unreadable answer") from None
        problem = _problem(resp)
        detail = str(problem.get("detail") or resp.reason_phrase)
        if problem.get("type", "").endswith("/not-leader"):
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


def _problem(resp: httpx.Response) -> dict:
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _now() -> float:
    return time.monotonic() * 1000.0
