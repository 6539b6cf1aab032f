"""Envoy's rate limit quota service (``envoy.service.rate_limit_quota.v3.RateLimitQuotaService/
StreamRateLimitQuotas``), served beside the rate limit service on ``--rls-port`` (``--rlqs``).

Envoy's quota filter (``envoy.filters.http.rate_limit_quota``, work in progress upstream) keeps
one stream per Envoy, reports per bucket how many requests it allowed and denied (Envoy 1.40:
every 5 s, and at once for a bucket it has not seen), and enforces locally the assignment the
server pushes per bucket. Here every assignment is **tokens the agent took first**, with a time to live
(region_agent.leasing.rlqs_funding: the agent's one admission, at the cost of the assignment), so
an Envoy never admits more than the region held for it; what it does without an assignment is
its ``no_assignment_behavior`` / ``expired_assignment_behavior`` (deny-all in the shipped
``deploy/gateways/envoy-rlqs.yaml``; kernel.bound counts anything else).

What is sent, per bucket (:func:`fresh_actions` and friends are the one adapter to Envoy's
behaviour, checked against the real binary by ``tests/e2e/gateways/test_envoy_rlqs.py``):

* a **fresh assignment** of N tokens: a token bucket of ``max_tokens`` N that refills one token
  per ten years (none in practice), with a time to live in whole seconds — sent after a
  ``DENY_ALL`` for the same bucket in the same response, because Envoy 1.40 keeps the tokens of a
  token bucket when the same one is sent again and scales them when another one replaces it, but
  starts a bucket full after a blanket rule: so N is exactly what Envoy may spend;
* a **renewal**: the same token bucket again, sent when half its time to live is gone and tokens
  are left: Envoy keeps its tokens and restarts the time to live (never past the window the
  tokens came from). Envoy keeps them only if the renewal arrives while the assignment is still
  live there; one arriving after Envoy's own expiry starts full. So a renewal is sent only while
  the assignment has longer than ``--rlqs-delivery-ms`` to live (the latest anything sent can
  arrive: the shipped ``envoy-rlqs.yaml`` closes a connection that answers no HTTP/2 ping within
  a second: rlqs_funding.renewal_ttl);
* an **end**: ``DENY_ALL`` once an assignment's time to live has run out as the agent counts it
  (from when it was sent) and no fresh one replaced it. Envoy counts a time to live from when the
  assignment arrives, so one held up on a stalled stream and delivered when it resumes would
  otherwise live past the window its tokens came from; the end, sent behind it on the same stream,
  arrives after it and ends it (rlqs_funding.needs_end);
* ``DENY_ALL`` for a bucket the agent refuses (an unmapped key, a per-request rule, another
  domain: counted by reason) and to **revoke** assignments a policy change altered;
* ``abandon_action`` for a bucket idle for ``--rlqs-idle-ms``: Envoy forgets it and reports it at
  once when it is used again.

A stream that breaks ends nothing at once: the assignments it carried stay Envoy's until they
expire and are abandoned (their unused tokens counted as stranded), never refunded or renewed.
A bucket whose Envoy has not reported it for one report interval and ``QUIET_GRACE_MS`` (a stalled
stream) gets no fresh assignment until it reports again (rlqs_funding.silent).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf.message import DecodeError

from kernel.auth import TokenTable, authenticate
from kernel.bundle import Bundle
from kernel.errors import LeaseholdError, Unauthorized

from ..decision.plan import Snapshot
from ..leasing import rlqs_funding as fund
from .mapping import BadQuestion
from .metrics import GatewayMetrics
from .rlqs_mapping import (
    BucketKey,
    RlqsNames,
    Ttl,
    WindowEnd,
    assignment_ttl,
    bucket_key,
    bucket_question,
    fixed_window_end,
    per_request_reason,
)
from .rls import log_refused

log = logging.getLogger(__name__)

SERVICE = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"
Response = rlqs_pb2.RateLimitQuotaResponse
BucketAction = Response.BucketAction
FILL_INTERVAL_S = 10 * 365 * 86_400  # one token per ten years: a token bucket that does not refill
TICK_S = 0.1
LEAD_MS = 300.0  # a holding gets its next assignment when it has about this much of its demand left
QUIET_GRACE_MS = 1_000.0  # a bucket not reported for one report interval and this long is silent (rlqs_funding.silent)
DENY_TTL_S = 60
RETRY_MAX_MS = 1_000  # a denied round is asked again at most this much later
# responses queued on a stream that its Envoy has not read yet: past this many, the stream's next
# report is not read until Envoy reads (a client that reports and never reads is held by its own
# flow control, not by the agent's memory)
MAX_QUEUED = 64


# -------------------------------------------------------------------------- what Envoy is sent
def bucket_id(key: BucketKey) -> rlqs_pb2.BucketId:
    return rlqs_pb2.BucketId(bucket=dict(key))


def _token_bucket(bid: rlqs_pb2.BucketId, tokens: int, ttl_s: int) -> BucketAction:
    a = BucketAction(bucket_id=bid)
    q = a.quota_assignment_action
    q.assignment_time_to_live.seconds = ttl_s
    tb = q.rate_limit_strategy.token_bucket
    tb.max_tokens = tokens
    tb.tokens_per_fill.value = 1
    tb.fill_interval.seconds = FILL_INTERVAL_S
    return a


def deny_action(bid: rlqs_pb2.BucketId, ttl_s: int) -> BucketAction:
    a = BucketAction(bucket_id=bid)
    q = a.quota_assignment_action
    q.assignment_time_to_live.seconds = ttl_s
    q.rate_limit_strategy.blanket_rule = q.rate_limit_strategy.DENY_ALL
    return a


def fresh_actions(bid: rlqs_pb2.BucketId, tokens: int, ttl_s: int) -> list[BucketAction]:
    """A fresh assignment of exactly ``tokens`` (module doc): deny-all, then the token bucket."""
    return [deny_action(bid, 1), _token_bucket(bid, tokens, ttl_s)]


def renewal_actions(bid: rlqs_pb2.BucketId, tokens: int, ttl_s: int) -> list[BucketAction]:
    """The live assignment again (the same token bucket): no new tokens, a new time to live."""
    return [_token_bucket(bid, tokens, ttl_s)]


def abandon_action(bid: rlqs_pb2.BucketId) -> BucketAction:
    a = BucketAction(bucket_id=bid)
    a.abandon_action.SetInParent()
    return a


# -------------------------------------------------------------------------- state
@dataclass(eq=False)
class Stream:
    id: int
    peer: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # an answer was taken off the queue (MAX_QUEUED)
    holdings: dict[BucketKey, fund.Holding] = field(default_factory=dict)
    pending: list[BucketAction] = field(default_factory=list)
    alive: bool = True
    invalid: str | None = None  # why the stream ends INVALID_ARGUMENT (a message that is not a report)
    opened_ms: float = 0.0
    last_report_ms: float = 0.0

    def send(self, actions: list[BucketAction]) -> None:
        if self.alive:
            self.pending.extend(actions)

    async def next(self) -> Response | None:
        """The next answer to send (None: the stream ends)."""
        msg = await self.queue.get()
        self.drained.set()
        return msg

    def flush(self) -> None:
        if self.pending and self.alive:
            self.queue.put_nowait(Response(bucket_action=self.pending))
        self.pending = []


@dataclass(eq=False)
class Bucket:
    """One bucket id, across every Envoy reporting it: its question, and its single funding round."""

    key: BucketKey
    question: Any  # AdmitRequest | None
    refused: str | None
    signature: bytes = b""
    burst: int = 1  # the most one decision can take: the smallest burst of the bucket's rules
    own_rate: float = 0.0  # the refill of rules that are all its principal's own (rlqs_funding.own_rate)
    holdings: set[fund.Holding] = field(default_factory=set)
    round: asyncio.Task | None = None
    again: bool = False
    # what Envoy is sent, built once while the bucket is tracked: its id (every action names it) and
    # its renewals, one per (tokens, time to live in seconds): thousands of buckets are renewed every
    # few seconds with the same few values (RlqsService.bucket_id, RlqsService.renewal)
    bid: rlqs_pb2.BucketId | None = None
    renewals: dict[tuple[int, int], BucketAction] = field(default_factory=dict)


class RlqsService:
    """Every RLQS stream of this agent process, their holdings and the funding rounds."""

    def __init__(self, *, settings: Any, names: RlqsNames, decide: fund.Decide, state_of: Callable[[], Any],
                 metrics: GatewayMetrics, gateways: TokenTable | None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.s = settings
        self.names = names
        self.decide = decide
        self.state_of = state_of
        self.metrics = metrics
        self.gateways = gateways
        self.clock, self.wall = clock, wall
        self.streams: dict[int, Stream] = {}
        self.buckets: dict[BucketKey, Bucket] = {}
        self.held = 0  # holdings of every stream, closed streams' until they are retired (--rlqs-max-agent-buckets)
        self._ids = itertools.count(1)
        self._heap: list[tuple[float, int, fund.Holding]] = []
        self._seq = itertools.count()
        self._due: dict[int, float] = {}  # id(holding) -> its scheduled check
        # a reported bucket id's bytes -> its key: Envoy sends the same ids in every report, and
        # bucket_key (the entries read out of the protobuf map, sorted, checked) was about a third
        # of a bucket's report; only ids bucket_key accepted, as many as the streams may hold
        self._keys: dict[bytes, BucketKey] = {}
        self._renewed = metrics.rlqs_assignments.labels("renewal")
        self._bundle: Bundle | None = None
        self._ticker: asyncio.Task | None = None
        self.interval_ms = float(settings.rlqs_report_interval_ms)
        self.span_ms = self.interval_ms + 1_000.0  # an assignment lasts one report interval and a second
        self.quiet_ms = self.interval_ms + QUIET_GRACE_MS  # no fresh assignment for a bucket silent this long
        self.delivery_ms = float(settings.rlqs_delivery_ms)  # nothing sent arrives later (rlqs_funding.renewal_ttl)

    def now_ms(self) -> float:
        return self.clock() * 1000.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_loop())

    async def stop(self) -> None:
        for st in list(self.streams.values()):
            st.alive = False
            st.queue.put_nowait(None)
        rounds = [b.round for b in self.buckets.values() if b.round is not None]
        for t in [self._ticker, *rounds]:
            if t is not None:
                t.cancel()
        for t in [self._ticker, *rounds]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        self._ticker = None

    # ------------------------------------------------------------------ the stream
    async def stream(self, requests: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Response]:
        if self.gateways is not None:
            try:
                authenticate(self.gateways, context.invocation_metadata() or ())
            except Unauthorized as e:
                self.metrics.rlqs_unauthenticated.inc()
                log_refused(context.peer(), "RLQS stream")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, e.detail)
        # refused for the agent's own reasons, each attempt counted (LeaseholdRlqsStreamsAtCap): an
        # Envoy refused its stream has no assignment, and the shipped envoy-rlqs.yaml then denies
        # every identified request until a later attempt is let in
        if self.state_of().engine is None:
            self.metrics.rlqs_refused_streams.labels("not_ready").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "agent is starting")
        if len(self.streams) >= self.s.rlqs_max_streams:  # each holds a slot of the port for its life
            self.metrics.rlqs_refused_streams.labels("exhausted").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many RLQS streams (--rlqs-max-streams)")
        st = Stream(next(self._ids), context.peer() or "", opened_ms=self.now_ms())
        self.streams[st.id] = st
        self._streams_changed()
        reader = asyncio.create_task(self._read(st, requests))
        try:
            while True:
                msg = await st.next()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self._closed(st)
        if st.invalid is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, st.invalid)

    async def _read(self, st: Stream, requests: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports]) -> None:
        try:
            async for msg in requests:
                while st.queue.qsize() >= MAX_QUEUED and st.alive:  # Envoy does not read: neither do we
                    st.drained.clear()
                    await st.drained.wait()
                try:
                    self.on_report(st, msg)
                except Exception:  # one bad report must not end the stream
                    log.exception("RLQS report failed")
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        except DecodeError:  # grpcio's parse of the next message: the stream cannot go on
            st.invalid = "a message is not a RateLimitQuotaUsageReports"
            self.metrics.rlqs_refused.labels("undecodable").inc()
        finally:
            st.queue.put_nowait(None)

    def _streams_changed(self) -> None:
        """The streams open, and their fraction of --rlqs-max-streams (LeaseholdRlqsStreamsNearCap)."""
        n = len(self.streams)
        self.metrics.rlqs_streams.set(n)
        self.metrics.rlqs_streams_fill.set(n / self.s.rlqs_max_streams)

    def _closed(self, st: Stream) -> None:
        """The stream ended: its assignments run out in Envoy at their time to live (kept for the
        accounting until they expire), nothing more is sent on it."""
        if not st.alive and st.id not in self.streams:
            return
        st.alive = False
        self.streams.pop(st.id, None)
        self._streams_changed()
        now = self.now_ms()
        for h in st.holdings.values():
            self._schedule(h, max(now, h.expires_at_ms))

    # ------------------------------------------------------------------ reports
    def on_report(self, st: Stream, msg: rlqs_pb2.RateLimitQuotaUsageReports) -> None:
        now = self.now_ms()
        st.last_report_ms = now
        m = self.metrics
        m.rlqs_reports.inc()
        allowed_sum = denied_sum = 0
        keys = self._keys
        for u in msg.bucket_quota_usages:
            allowed, denied = u.num_requests_allowed, u.num_requests_denied
            allowed_sum += allowed
            denied_sum += denied
            wire = u.bucket_id.SerializeToString()
            key = keys.get(wire)
            if key is None:
                try:
                    key = bucket_key(u.bucket_id.bucket.items())
                except BadQuestion as e:
                    m.rlqs_refused.labels(e.reason).inc()
                    st.send([deny_action(u.bucket_id, DENY_TTL_S)])
                    continue
                if len(keys) >= min(self.s.rlqs_max_buckets * max(1, len(self.streams)), self.s.rlqs_max_agent_buckets):
                    keys.clear()  # as many as the streams may hold: refilled by the next report
                keys[wire] = key
            h = st.holdings.get(key)
            if h is None:
                if len(st.holdings) >= self.s.rlqs_max_buckets or self.held >= self.s.rlqs_max_agent_buckets:
                    m.rlqs_refused.labels("too_many_buckets").inc()
                    st.send([deny_action(u.bucket_id, DENY_TTL_S)])
                    continue
                h = self._hold(st, key, msg.domain)
            fund.observe(h, allowed, denied, now, self.interval_ms)
            if h.refused is not None:
                m.rlqs_refused.labels(h.refused).inc()
                st.send([deny_action(u.bucket_id, DENY_TTL_S)])
                self._schedule(h, now + self.s.rlqs_idle_ms)  # abandoned once no longer used (_check)
                continue
            self._consider(h, now)
        if allowed_sum:
            m.rlqs_usage.labels("allowed").inc(allowed_sum)
        if denied_sum:
            m.rlqs_usage.labels("denied").inc(denied_sum)
        st.flush()

    def _hold(self, st: Stream, key: BucketKey, domain: str) -> fund.Holding:
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = self._bucket(key)
        refused = b.refused
        if domain != self.names.domain:
            refused = "unknown_domain"
        h = fund.Holding(stream=st.id, bucket=key, question=b.question if refused is None else None,
                         refused=refused, signature=b.signature)
        st.holdings[key] = h
        b.holdings.add(h)
        self.held += 1
        self.metrics.rlqs_buckets.inc()
        return h

    def _bucket(self, key: BucketKey) -> Bucket:
        try:
            q = bucket_question(self.names, self.names.domain, key, cost=1, request_id="rlqs-bucket")
        except BadQuestion as e:
            return Bucket(key, None, e.reason)
        except LeaseholdError:
            return Bucket(key, None, "bad_value")
        refused, signature, burst, own = self._judge(q)
        return Bucket(key, q, refused, signature, burst, own)

    def _judge(self, q: Any) -> tuple[str | None, bytes, int, float]:
        """(refusal reason or None, the rules' signature, the smallest burst of the rules, their
        refill when they are all the principal's own: rlqs_funding.own_rate) of a question under the
        bundle in force."""
        snap: Snapshot = self.state_of().holder.snapshot
        shape = self._shape(snap, q)
        rules = shape.enforced
        sig = b"|".join(msgspec.json.encode(r) for r in rules)
        pools = snap.pools
        sig += b"#" + b"|".join(msgspec.json.encode(pools[r.pool_id]) for r in rules
                                if r.pool_id is not None and r.pool_id in pools)
        burst = min((int(r.capacity(pools)[1]) for r in rules), default=fund.MAX_COST)
        own = fund.own_rate(rules, pools, q.principal.type)
        return per_request_reason(rules), sig, max(1, min(fund.MAX_COST, burst)), own

    def _shape(self, snap: Snapshot, q: Any) -> Any:
        sub = None
        if q.tenant_id in snap.splits and q.principal.type != "anonymous":  # the sub-bucket its admission spends
            sub = self.state_of().keys.sub_bucket(q.tenant_id, q.principal.type, q.principal.id,
                                                  snap.splits[q.tenant_id])
        return snap.shape(q.tenant_id, q.route_group, q.principal.type, q.principal.api_key_id is not None, sub)

    # ------------------------------------------------------------------ what a holding needs
    def _consider(self, h: fund.Holding, now: float) -> None:
        if fund.wants_tokens(h, now, LEAD_MS, self.quiet_ms):
            self._want(h)
        self._schedule(h, fund.next_check_ms(h, now, LEAD_MS, self.quiet_ms, self.delivery_ms))

    def _schedule(self, h: fund.Holding, at_ms: float) -> None:
        b = self.buckets.get(h.bucket)
        if b is None or h not in b.holdings:
            return  # dropped (a round that waited on the admission ends after it): never looked at again
        at_ms = max(at_ms, self.now_ms() + TICK_S * 1000)
        cur = self._due.get(id(h))
        if cur is not None and cur <= at_ms:
            return  # an earlier check is already due
        self._due[id(h)] = at_ms
        heapq.heappush(self._heap, (at_ms, next(self._seq), h))

    def _want(self, h: fund.Holding) -> None:
        h.wanting = True
        b = self.buckets.get(h.bucket)
        if b is None:
            return
        if b.round is None:
            b.round = asyncio.create_task(self._rounds(b))
        else:
            b.again = True

    # ------------------------------------------------------------------ funding rounds
    async def _rounds(self, b: Bucket) -> None:
        try:
            while True:
                b.again = False
                await self._round(b)
                if not b.again:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            self.metrics.rlqs_rounds.labels("error").inc()
            log.exception("RLQS funding round failed")
        finally:
            b.round = None
            if not b.holdings and self.buckets.get(b.key) is b:  # its holdings were dropped meanwhile
                del self.buckets[b.key]

    def ttl_for(self, b: Bucket) -> Ttl:
        """The time to live of an assignment of ``b`` funded now (rlqs_mapping.assignment_ttl)."""
        st = self.state_of()
        memo: Snapshot = st.holder.snapshot
        windows: list[WindowEnd] = []
        wall = self.wall() * 1000.0
        for r in self._shape(memo, b.question).enforced:
            if r.kind.code == "fw" and getattr(r, "window_ms", None):
                windows.append(fixed_window_end(r.window_ms, wall))
            pool = memo.pools.get(r.pool_id) if r.pool_id is not None else None
            if pool is not None and st.engine is not None:
                w = st.engine.pool_windows(pool)
                windows.append(WindowEnd(pool.window_ms, w.safe_ms if w.span == 1 else 0))
        return assignment_ttl(windows, max_ttl_s=self.s.rlqs_max_ttl_s, margin_ms=self.s.rlqs_clock_margin_ms)

    async def _round(self, b: Bucket) -> None:
        t0 = self.now_ms()
        parties = [h for h in b.holdings
                   if h.wanting and self._alive(h) and fund.wants_tokens(h, t0, LEAD_MS, self.quiet_ms)]
        for h in b.holdings:
            h.wanting = False
        if not parties or b.question is None:
            return
        m = self.metrics
        ttl = self.ttl_for(b)
        if ttl.seconds == 0:
            m.rlqs_rounds.labels("window_end").inc()
            for h in parties:
                h.retry_at_ms = t0 + max(ttl.wait_ms, TICK_S * 1000)
                self._schedule(h, h.retry_at_ms)
            return
        # the bucket's short Envoys join whichever Envoy's report started the round (rlqs_funding.waiting)
        parties += [o for o in b.holdings if o not in parties and self._alive(o)
                    and fund.waiting(o, t0, self.span_ms, LEAD_MS, self.quiet_ms)]
        cap = self.s.rlqs_max_assignment
        # the time to live the assignment is sent with (whole seconds, ending before the clamp), and
        # the need sized by it: tokens for the clamp's fraction of a second past it would be stranded
        clamp_at = t0 + ttl.clamp_ms
        ttl_s = ttl.seconds
        needs = {h: fund.need(h, self.span_ms, cap, ttl_s * 1000.0, b.own_rate) for h in parties}
        taken = await fund.take(self.decide, b.question, min(b.burst, sum(needs.values())))
        now = self.now_ms()
        if math.isfinite(clamp_at):  # a round that took long may have passed a whole second of the clamp
            ttl_s = min(ttl_s, int((clamp_at - now) // 1000))
        if taken.tokens == 0 or ttl_s < 1:
            m.rlqs_rounds.labels("denied").inc()
            if log.isEnabledFor(logging.DEBUG):
                d = taken.decision
                log.debug("RLQS round for %s denied (streams %s; retry in %d ms; asked %s; the last said "
                          "remaining %s, by %s)", dict(b.key), [h.stream for h in parties], taken.retry_ms,
                          list(taken.asked), d.remaining if d else None, d.source if d else None)
            if taken.tokens:  # funded, but its window ended while the round waited: never sent
                m.rlqs_stranded_tokens.inc(taken.tokens)
            for h in parties:
                if not taken.tokens:  # the bucket had nothing (not a window that ended mid-round)
                    h.short_at_ms = now
                # the hint is for the whole asked cost; a token or two return sooner, and the next
                # round asks for what is left (partial assignments): look again within a second
                h.retry_at_ms = now + min(RETRY_MAX_MS, max(250, taken.retry_ms))
                self._schedule(h, h.retry_at_ms)
            return
        m.rlqs_rounds.labels("granted" if taken.tokens >= sum(needs.values()) else "partial").inc()
        gives = fund.share(taken.tokens, needs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("RLQS round for %s: %d tokens for %s", dict(b.key), taken.tokens,
                      ", ".join(f"stream {h.stream} (demand {h.demand:.1f}/s, need {needs[h]}): {g}"
                                for h, g in gives.items()))
        touched: set[Stream] = set()
        unsent = 0
        for h, give in gives.items():
            h.short_at_ms = now if give < needs[h] else 0.0
            st = self.streams.get(h.stream)
            if give <= 0 or st is None or not st.alive:
                unsent += give
                if give <= 0:
                    h.retry_at_ms = now + 1_000
                    self._schedule(h, h.retry_at_ms)
                continue
            st.send(fresh_actions(self.bucket_id(h.bucket), give, ttl_s))
            m.rlqs_stranded_tokens.inc(h.settle(now))
            fund.granted(h, give, ttl_s, now, clamp_at)
            m.rlqs_assignments.labels("fresh").inc()
            m.rlqs_assigned_tokens.inc(give)
            touched.add(st)
            self._schedule(h, fund.next_check_ms(h, now, LEAD_MS, self.quiet_ms, self.delivery_ms))
        unsent += taken.tokens - sum(gives.values())
        if unsent:
            m.rlqs_stranded_tokens.inc(unsent)
        for st in touched:
            st.flush()

    def bucket_id(self, key: BucketKey) -> rlqs_pb2.BucketId:
        """The bucket's id as Envoy is sent it: built once while the bucket is tracked."""
        b = self.buckets.get(key)
        if b is None:
            return bucket_id(key)
        if b.bid is None:
            b.bid = bucket_id(key)
        return b.bid

    def renewal(self, h: fund.Holding, ttl_s: int) -> list[BucketAction]:
        """:func:`renewal_actions` of the holding's live assignment, built once per (tokens, time to
        live) of its bucket (a response copies what it is given)."""
        b = self.buckets.get(h.bucket)
        if b is None:
            return renewal_actions(bucket_id(h.bucket), h.chunk, ttl_s)
        a = b.renewals.get((h.chunk, ttl_s))
        if a is None:
            if len(b.renewals) >= 8:  # Envoys of one bucket hold a few sizes at most; never more than these
                b.renewals.clear()
            (a,) = renewal_actions(self.bucket_id(h.bucket), h.chunk, ttl_s)
            b.renewals[(h.chunk, ttl_s)] = a
        return [a]

    def _alive(self, h: fund.Holding) -> bool:
        st = self.streams.get(h.stream)
        return st is not None and st.alive

    # ------------------------------------------------------------------ the ticker
    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:
                log.exception("RLQS tick failed")

    def tick(self) -> None:
        now = self.now_ms()
        bundle = self.state_of().holder.bundle
        if bundle is not self._bundle:  # also the first tick: a bucket may have been judged before it
            self._policy_changed(now)
            self._bundle = bundle
        touched: set[Stream] = set()
        due: list[fund.Holding] = []
        while self._heap and self._heap[0][0] <= now:  # what is due now; a check due again waits a tick
            at, _, h = heapq.heappop(self._heap)
            if self._due.get(id(h)) == at:
                del self._due[id(h)]
                due.append(h)
        for h in due:
            st = self.streams.get(h.stream)
            if st is None or not st.alive:
                self._retire(h, now)
                continue
            self._check(st, h, now)
            touched.add(st)
        for st in touched:
            st.flush()

    def _check(self, st: Stream, h: fund.Holding, now: float) -> None:
        m = self.metrics
        stranded = h.settle(now)
        if stranded:
            m.rlqs_stranded_tokens.inc(stranded)
        if h.refused is not None:
            if now - h.last_traffic_ms >= self.s.rlqs_idle_ms:
                self._abandon(st, h)
            else:
                self._schedule(h, now + self.s.rlqs_idle_ms)
            return
        if fund.needs_end(h, now):  # whether or not the stream still reports: a stalled one most of all
            st.send([deny_action(self.bucket_id(h.bucket), DENY_TTL_S)])
            fund.ended(h, now)
            m.rlqs_assignments.labels("end").inc()
        ttl = fund.renewal_ttl(h, now, self.s.rlqs_max_ttl_s, self.delivery_ms)
        if ttl and now - st.last_report_ms <= 2 * self.interval_ms:  # a stream that still reports
            st.send(self.renewal(h, ttl))
            fund.renewed(h, ttl, now)
            self._renewed.inc()
        if not h.live(now) and now - h.last_traffic_ms >= self.s.rlqs_idle_ms and not h.wanting:
            self._abandon(st, h)
            return
        self._consider(h, now)

    def _abandon(self, st: Stream, h: fund.Holding) -> None:
        st.send([abandon_action(self.bucket_id(h.bucket))])
        self.metrics.rlqs_assignments.labels("abandon").inc()
        st.holdings.pop(h.bucket, None)
        self._drop(h)

    def _retire(self, h: fund.Holding, now: float) -> None:
        """A holding of a closed stream: once its assignment is over, the rest is stranded."""
        if h.live(now):
            self._schedule(h, h.expires_at_ms)
            return
        self.metrics.rlqs_stranded_tokens.inc(h.settle(now))
        self._drop(h)

    def _drop(self, h: fund.Holding) -> None:
        self._due.pop(id(h), None)
        self.held -= 1
        self.metrics.rlqs_buckets.dec()
        b = self.buckets.get(h.bucket)
        if b is not None:
            b.holdings.discard(h)
            if not b.holdings and b.round is None:
                del self.buckets[h.bucket]

    def _policy_changed(self, now: float) -> None:
        """A new bundle: a bucket whose rules (or their pools) changed has its assignments revoked
        at once — deny-all, their leftovers abandoned — and is funded again under the new rules."""
        touched: set[Stream] = set()
        for b in list(self.buckets.values()):
            if b.question is None:
                continue
            refused, sig, burst, own = self._judge(b.question)
            if sig == b.signature and refused == b.refused:
                continue
            b.refused, b.signature, b.burst, b.own_rate = refused, sig, burst, own
            for h in list(b.holdings):
                st = self.streams.get(h.stream)
                if h.refused != "unknown_domain":
                    h.refused = refused
                    h.question = b.question if refused is None else None
                h.signature = sig
                if st is None or not st.alive:
                    continue
                if h.live(now) or refused is not None:
                    st.send([deny_action(self.bucket_id(h.bucket), 1 if refused is None else DENY_TTL_S)])
                    fund.revoke(h, now)
                    self.metrics.rlqs_assignments.labels("revoke").inc()
                    touched.add(st)
                if refused is None and h.demand > 0:
                    self._want(h)
        for st in touched:
            st.flush()

    # ------------------------------------------------------------------ operators
    def view(self) -> dict[str, Any]:
        """Assignments per bucket (``GET /v1/rlqs``; the demo's live view)."""
        now = self.now_ms()
        out = []
        for b in self.buckets.values():
            holders = []
            for h in b.holdings:
                holders.append({"stream": h.stream, "live": h.live(now), "tokens": h.chunk,
                                "left": round(h.left(now), 1), "expiresInMs": max(0, int(h.expires_at_ms - now)),
                                "demandPerS": round(h.demand, 2), "allowed": h.allowed, "denied": h.denied,
                                "funded": h.funded, "stranded": h.stranded, "refused": h.refused})
            out.append({"bucket": dict(b.key), "refused": b.refused, "envoys": sorted(holders, key=lambda x: x["stream"])})
        return {"streams": [{"id": s.id, "peer": s.peer, "buckets": len(s.holdings)} for s in self.streams.values()],
                "buckets": sorted(out, key=lambda x: sorted(x["bucket"].items()))}


class RateLimitQuotaServicer(rlqs_pb2_grpc.RateLimitQuotaServiceServicer):
    def __init__(self, service: RlqsService):
        self.service = service

    async def StreamRateLimitQuotas(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        async for response in self.service.stream(request_iterator, context):
            yield response


def add_to_server(service: RlqsService, server: grpc.aio.Server) -> None:
    rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(RateLimitQuotaServicer(service), server)


__all__ = ["SERVICE", "RateLimitQuotaServicer", "RlqsService", "abandon_action", "add_to_server", "bucket_id",
           "deny_action", "fresh_actions", "renewal_actions"]
