"""Quota assignments for Envoys (RLQS), funded by what this agent holds.

An Envoy enforces an assignment per bucket locally; every token it may admit was taken first,
here, from the rules the bucket stands for — **by the agent's one admission**: a question of
``cost`` N (the bucket's question, :func:`region_agent.gateways.rlqs_mapping.bucket_question`)
debits N tokens from the tenant's and user's buckets in one multi-rule script call, from a
tenant pool's leased balance, or from a fleet-wide pool's chunk (region_agent.leasing), with the
same fallbacks and fail modes as any request; so an assignment is never more than the region
holds. Then:

* **single-flight per bucket**: one funding round per bucket at a time (region_agent.gateways.rlqs); the
  Envoys that need tokens meanwhile join the next round;
* **demand-weighted**: a round asks for every waiting Envoy's need (its demand over one report
  interval, at most ``max_assignment``) at once, and when it gets less, shares it by demand with
  :func:`kernel.fair_share.split`, each Envoy's rounding carried to its next round (a scarce
  bucket's rounds are a token or two, and rounded alone each went to the busiest Envoy);
* **demand-weighted across rounds**: Envoys report at different moments, so a round is often
  started by one Envoy of a bucket, and alone in it that Envoy would take all the bucket has. An
  Envoy of the bucket that is **short** (a round within one report span gave it less than it
  asked, and its assignment is running out) joins every round of its bucket until one funds it in
  full (:func:`waiting`), so what the bucket has is shared by demand whichever Envoy's report
  started the round;
* **partial chunks**: a denied round learns what is left from the denial and asks again for that
  (twice at most), as the fleet pools' chunks do near the limit (partial chunks); a denial the
  agent's negative cache held, saying none is left, is probed with one token (:func:`take`);
* **a principal's own rules are funded their refill**: a bucket whose rules are all its principal's
  own carries at least their refill over the span, whatever its reported demand (:func:`own_rate`,
  :func:`need`): a rule nobody else spends would otherwise sit full between Envoy's reports;
* **a silent bucket is not funded**: one Envoy has not reported for one report interval and a
  grace (a stalled stream) gets no fresh assignment until it reports again (:func:`silent`);
* **a fresh assignment replaces the last**: its unspent tokens are abandoned, never refunded (an
  ambiguous refund could count twice), and counted as stranded once Envoy's reports show how
  many were not used (:meth:`Holding.settle`).
* **an assignment that runs out is ended**: Envoy starts a time to live when it *receives* the
  assignment, so one held up on a stalled connection (a blackholed stream, delivered when it heals)
  would live past the end of the window its tokens came from. When its time to live has run out as
  the agent counts it (from when it was sent) and no fresh assignment replaced it, the agent says so
  (:func:`needs_end`): a ``DENY_ALL`` on the same stream, which Envoy receives after it, in order.

Pure state and arithmetic (:class:`Holding`, :func:`observe` and its demand average
:func:`demand_after`, :func:`wants_tokens`, :func:`need`)
plus what one round asks the admission (:func:`take`) and how it shares the answer (:func:`share`);
the stream, the rounds' scheduling, timers and protobuf are region_agent.gateways.rlqs.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernel.fair_share import split

from ..models import AdmitRequest, Decision, DecisionSource

INF = math.inf
MAX_COST = 1_000  # AdmitRequest.costHint
ROUND_ATTEMPTS = 3  # a round: the whole need, then what a denial says is left, then half of that
DEMAND_TAU_INTERVALS = 2.0  # the demand average forgets by e in this many report intervals (demand_after)
RENEW_LEAD_MS = 300.0  # a renewal is due this long before the last moment it may be sent (renew_at_ms)
CHANGE_SIGMAS = 3.0  # a report's count this many Poisson deviations from the average's: a change, not noise


@dataclass(eq=False, slots=True)
class Holding:
    """One Envoy's (one stream's) view of one bucket: what it holds and what it reports."""

    stream: int
    bucket: tuple  # region_agent.gateways.rlqs_mapping.BucketKey
    question: AdmitRequest | None  # None: refused (``refused`` says why)
    refused: str | None = None
    signature: bytes = b""  # the rules the bucket stands for (a policy change that alters them revokes)
    # the assignment Envoy holds
    chunk: int = 0  # tokens of the last fresh assignment (0: none)
    pushed_at_ms: float = 0.0  # monotonic, when it (or its last renewal) was sent
    funded_at_ms: float = 0.0  # monotonic, when it was sent (a renewal adds no tokens: not moved by one)
    expires_at_ms: float = 0.0  # monotonic: sent + time to live (Envoy's clock starts at receipt: later)
    clamp_at_ms: float = INF  # monotonic: it must not be spendable after this (its window's end)
    ttl_s: int = 0
    used: float = 0.0  # requests Envoy reported admitted since the fresh assignment (an estimate)
    # what Envoy reported over the holding's life
    funded: int = 0  # tokens of every fresh assignment
    allowed: int = 0
    denied: int = 0
    stranded: int = 0  # counted so far (never decreases)
    demand: float = 0.0  # requests per second (allowed + denied), averaged (demand_after)
    requests_avg: float = 0.0  # the average's requests and seconds, exponentially weighted (demand_after)
    seconds_avg: float = 0.0
    last_report_ms: float = 0.0
    last_traffic_ms: float = 0.0
    retry_at_ms: float = 0.0  # no round for this holding before (a denied round's hint, a window's end)
    short_at_ms: float = 0.0  # monotonic: its last round gave it less than it asked (0: it got all)
    owed: float = 0.0  # what rounding its rounds' shares to whole tokens owes it (a fraction, kernel.fair_share.split)
    wanting: bool = False
    revoked: int = 0
    ended: bool = True  # Envoy was told the last assignment ended, or was never sent one (needs_end)

    def live(self, now_ms: float) -> bool:
        return self.chunk > 0 and now_ms < self.expires_at_ms

    def left(self, now_ms: float) -> float:
        """Tokens Envoy probably still holds: the chunk less what it reported spent of it, less the
        demand since its last report or since the chunk was sent, whichever is later — none of it
        was spent before it was sent (a round that waited for its admission, a slow lease, does
        not age the assignment it funds). Until Envoy's next report ``used`` is below zero by what
        it spent of the previous assignment after its last report (:func:`granted`): that part of
        the next report is not this chunk's."""
        if not self.live(now_ms):
            return 0.0
        since_ms = max(self.last_report_ms, self.funded_at_ms)
        since = max(0.0, now_ms - since_ms) / 1000.0 if since_ms else 0.0
        return max(0.0, self.chunk - max(0.0, self.used) - self.demand * since)

    def settle(self, now_ms: float) -> int:
        """Stranded tokens newly known: funded and not reported used, less what Envoy may still
        spend of its live assignment. Returns the increase (a counter's)."""
        outstanding = max(0.0, self.chunk - self.used) if self.live(now_ms) else 0.0
        known = max(0, int(self.funded - self.allowed - outstanding))
        grew = max(0, known - self.stranded)
        self.stranded += grew
        return grew


def observe(h: Holding, allowed: int, denied: int, now_ms: float, interval_ms: float) -> None:
    """One usage report of the holding's bucket (counts since Envoy's previous report of it).

    How long the counts took: since the holding's last report; on its first, Envoy's first report
    of a bucket it has just made comes at once with its first request (one request, which says
    nothing of the rate yet: taken as one a second), while a bucket Envoy already counted (its
    stream is new: the agent restarted, the stream broke) is first reported in Envoy's periodic
    report, one report interval's requests. Then :func:`demand_after`."""
    n = allowed + denied
    if h.last_report_ms:
        dt = now_ms - h.last_report_ms
    elif n <= 1:
        dt = min(interval_ms, 1_000.0)
    else:
        dt = interval_ms
    h.requests_avg, h.seconds_avg = demand_after(h.requests_avg, h.seconds_avg, n, max(0.5, dt / 1000.0),
                                                 interval_ms / 1000.0)
    h.demand = h.requests_avg / h.seconds_avg if h.seconds_avg > 0 else 0.0
    if h.demand < 0.01:
        h.demand = 0.0
    h.allowed += allowed
    h.denied += denied
    h.used += allowed
    h.last_report_ms = now_ms
    if allowed or denied:
        h.last_traffic_ms = now_ms


def demand_after(requests: float, seconds: float, n: int, secs: float, interval_s: float) -> tuple[float, float]:
    """The demand average after a report of ``n`` requests in ``secs``: (requests, seconds), both
    exponentially weighted by time (forgetting by ``e`` every ``DEMAND_TAU_INTERVALS`` report
    intervals), the demand their ratio. The same weight whether the report is above or below the
    average, so Poisson-like traffic is estimated without bias; and a report that is a **change**
    (its count further than ``CHANGE_SIGMAS`` Poisson deviations from what the average expects,
    over at least half an interval) starts the average afresh from it, up or down: a genuine rise
    is funded from its first report, while noise is averaged over about two reports. ``seconds``
    0: no average yet (the first report is the average)."""
    expected = requests / seconds * secs if seconds > 0 else 0.0
    if seconds <= 0 or (secs >= interval_s / 2
                        and abs(n - expected) > CHANGE_SIGMAS * math.sqrt(max(1.0, expected)) + 1.0):
        return float(n), secs
    keep = math.exp(-secs / (DEMAND_TAU_INTERVALS * interval_s))
    return requests * keep + n, seconds * keep + secs


def need(h: Holding, span_ms: float, cap: int, ttl_ms: float = INF, own_rate: float = 0.0) -> int:
    """The tokens one assignment should carry: the bucket's demand over ``span_ms`` (one report
    interval and a second) or over the time to live the assignment is sent with (``ttl_ms``: whole
    seconds, as Envoy counts them, ending before the window its tokens come from) when shorter —
    what Envoy holds when it ends is stranded, tokens other buckets could have had —, 1 at least,
    ``cap`` at most.

    ``own_rate``: the refill (requests a second) of a bucket whose rules are all its principal's
    own (:func:`own_rate`; 0 otherwise). Such a bucket's assignment carries at least that refill
    over the same span, whatever the demand says: Envoy reports every few seconds, so demand above
    the last report is invisible until the next one, and meanwhile a rule nobody else spends sits
    full and its refill is lost. A token of it that Envoy does not spend is one the rule would have
    lost anyway — its owner's demand was below the refill, so the rule would have filled up — and
    the rule's other gateways and Envoys still have what it holds beyond it."""
    rate = max(h.demand, own_rate)
    return max(1, min(cap, math.ceil(rate * min(span_ms, ttl_ms) / 1000.0)))


def own_rate(rules: Sequence[Any], pools: Mapping[str, Any], principal_type: str) -> float:
    """The refill (requests a second at cost 1) of a bucket whose enforced ``rules`` all count one
    principal's own requests — scoped to its user or its key, spending no pool, and asked for a
    principal that is not anonymous — the slowest of them; 0 when any rule is shared with other
    principals (a tenant's, a route's, an address's, a pool: funding its refill in advance could
    starve someone else) or there is none (:func:`need`)."""
    if not rules or principal_type == "anonymous":
        return 0.0
    if any(r.scope not in ("user", "key") or r.pool_id is not None or r.fleet_wide for r in rules):
        return 0.0
    return max(0.0, min(float(r.capacity(pools)[0]) for r in rules))


def runs_short(h: Holding, now_ms: float, lead_ms: float) -> bool:
    """The holding has demand and a bucket question, and its assignment is gone or about to run
    out: what is left lasts ``lead_ms`` or less at its demand, or, of an assignment of more than
    one token, one token or less is left.

    A one-token assignment is short only by the first: "one token or less" is the whole of it from
    the moment it is sent, and it was replaced at every check (each tick) by a fresh one that
    abandoned it unspent — for a bucket whose assignments are a token (a time to live of a second,
    a burst of one, a scarce bucket's partial rounds) the agent took about ten tokens a second
    from the bucket's rules and pools whatever the demand, and a pool of the rules ran dry in
    seconds with almost nothing admitted."""
    if h.question is None or h.demand <= 0:
        return False
    if not h.live(now_ms):
        return True
    return h.left(now_ms) <= max(h.demand * lead_ms / 1000.0, min(1.0, h.chunk - 1.0))


def silent(h: Holding, now_ms: float, quiet_ms: float) -> bool:
    """Envoy has not reported the holding's bucket for more than ``quiet_ms`` (one report interval
    and a grace, region_agent.gateways.rlqs): its stream is stalled (a partition that drops every
    packet) or Envoy no longer counts the bucket. What its demand predicts is then unknown, and
    tokens sent into a stalled stream are spent late or not at all (they are ended when it heals:
    :func:`needs_end`), so a silent holding gets no fresh assignment; its next report funds it at
    once (:func:`wants_tokens`)."""
    return now_ms - h.last_report_ms > quiet_ms


def wants_tokens(h: Holding, now_ms: float, lead_ms: float, quiet_ms: float = INF) -> bool:
    """Should a round fund this holding now: no round's denial holds it back, it is not
    :func:`silent`, and it :func:`runs_short`."""
    return now_ms >= h.retry_at_ms and not silent(h, now_ms, quiet_ms) and runs_short(h, now_ms, lead_ms)


def waiting(h: Holding, now_ms: float, span_ms: float, lead_ms: float, quiet_ms: float = INF) -> bool:
    """Should the holding join a round another Envoy of its bucket started: it is short (a round
    within ``span_ms`` gave it less than it asked), not :func:`silent`, and still :func:`runs_short`.
    A denial's hint does not hold it back here: the round asks the admission anyway, for all its
    parties at once."""
    return (bool(h.short_at_ms) and now_ms - h.short_at_ms <= span_ms and not silent(h, now_ms, quiet_ms)
            and runs_short(h, now_ms, lead_ms))


def renew_at_ms(h: Holding, delivery_ms: float) -> float:
    """When the holding's assignment is due a renewal: half its time to live left, or earlier when
    that half is not longer than ``delivery_ms`` and :data:`RENEW_LEAD_MS` (:func:`renewal_ttl`)."""
    return h.expires_at_ms - max(h.ttl_s * 500.0, delivery_ms + RENEW_LEAD_MS)


def next_check_ms(h: Holding, now_ms: float, lead_ms: float, quiet_ms: float = INF,
                  delivery_ms: float = 0.0) -> float:
    """When the holding should be looked at again without a report: its predicted run-out (not
    while it is :func:`silent`: its next report is), its renewal (:func:`renew_at_ms`), its
    expiry, or a denial's end."""
    t = now_ms + 60_000.0
    if h.live(now_ms):
        t = min(t, max(now_ms, renew_at_ms(h, delivery_ms)), h.expires_at_ms)
        if h.demand > 0 and not silent(h, now_ms, quiet_ms):
            left = h.left(now_ms)
            t = min(t, now_ms + max(0.0, (left / h.demand) * 1000.0 - lead_ms))
    if h.retry_at_ms > now_ms:
        t = min(t, h.retry_at_ms)
    return t


def renewal_ttl(h: Holding, now_ms: float, max_ttl_s: int, delivery_ms: float = 0.0) -> int:
    """Seconds a renewal of the live assignment may run from now (0: none): not past its clamp,
    at most ``max_ttl_s``, and only when it is due (:func:`renew_at_ms`), tokens are left, and the
    assignment has longer than ``delivery_ms`` to live.

    A renewal is the same token bucket again, and Envoy keeps its tokens only if the assignment it
    renews is still live there when it **arrives**; one that arrives after Envoy's own time to live
    ran out finds the deny-all fallback and starts the token bucket full: tokens nobody took.
    Envoy's time to live started when the assignment arrived, after the agent sent it, so it ends
    no sooner than :attr:`Holding.expires_at_ms`; a renewal sent more than ``delivery_ms`` before
    that arrives in time if nothing the agent sends can arrive later than ``delivery_ms`` — what the
    shipped Envoy's HTTP/2 keepalive makes true: it closes a connection that stalls for longer, and
    what the agent sent into it never arrives
    (docs/decisions/0095-rlqs-renewals-only-within-the-delivery-bound.md)."""
    if (not h.live(now_ms) or h.left(now_ms) < 1.0 or now_ms < renew_at_ms(h, delivery_ms)
            or h.expires_at_ms - now_ms <= delivery_ms):
        return 0
    limit = min(max_ttl_s * 1000.0, h.clamp_at_ms - now_ms)
    secs = int(limit // 1000)
    return secs if now_ms + secs * 1000.0 > h.expires_at_ms else 0


def granted(h: Holding, tokens: int, ttl_s: int, now_ms: float, clamp_at_ms: float) -> None:
    """A fresh assignment of ``tokens`` was sent: the last one's leftover is abandoned."""
    gap = 0.0
    if h.live(now_ms) and h.last_report_ms:  # what Envoy spent of the old one since its last report
        gap = min(max(0.0, h.chunk - h.used), h.demand * max(0.0, now_ms - h.last_report_ms) / 1000.0)
    h.chunk = tokens
    h.used = -gap  # the next report counts those too
    h.funded += tokens
    h.pushed_at_ms = h.funded_at_ms = now_ms
    h.ttl_s = ttl_s
    h.expires_at_ms = now_ms + ttl_s * 1000.0
    h.clamp_at_ms = clamp_at_ms
    h.retry_at_ms = 0.0
    h.ended = False


def needs_end(h: Holding, now_ms: float) -> bool:
    """Must Envoy be told that the holding's assignment has ended: its time to live has run out as
    the agent counts it (from when it, or its last renewal, was sent), no fresh assignment replaced
    it, and Envoy was not told yet.

    Envoy counts a time to live from when the assignment *arrives*: sent on a stream that stalls (a
    partition that drops every packet, healed later), it arrives late and lives past the end of the
    window its tokens came from, into windows whose tokens are already spoken for. The end (a
    ``DENY_ALL`` sent on the same stream, see :func:`ended`) arrives after it, in order: with it at
    the latest when the stream resumes, so the late assignment is ended as it lands. On time, the
    end arrives when Envoy's own time to live has just run out, and changes nothing."""
    return h.chunk > 0 and not h.ended and now_ms >= h.expires_at_ms


def ended(h: Holding, now_ms: float) -> None:
    """Envoy was sent the end of the holding's assignment (:func:`needs_end`)."""
    h.ended = True
    h.expires_at_ms = min(h.expires_at_ms, now_ms)


def renewed(h: Holding, ttl_s: int, now_ms: float) -> None:
    h.pushed_at_ms = now_ms
    h.ttl_s = ttl_s
    h.expires_at_ms = now_ms + ttl_s * 1000.0


def revoke(h: Holding, now_ms: float) -> None:
    """The assignment is withdrawn (a policy change): what it had left is abandoned."""
    h.expires_at_ms = min(h.expires_at_ms, now_ms)
    h.revoked += 1
    h.ended = True  # the revocation is a DENY_ALL: the end


# ------------------------------------------------------------------------------------------ rounds
Decide = Callable[[list[AdmitRequest]], Awaitable[list[Decision]]]


@dataclass(slots=True)
class Taken:
    tokens: int
    decision: Decision | None  # the last decision of the round (the granted one, or the last denial)
    asked: tuple[int, ...] = ()  # the cost of each decision, in order (the round's debug log)

    @property
    def attempts(self) -> int:
        return len(self.asked)

    @property
    def retry_ms(self) -> int:
        d = self.decision
        if d is None or self.tokens:
            return 0
        return d.retry_after_ms if d.retry_after_ms > 0 else 1_000


def with_cost(q: AdmitRequest, cost: int) -> AdmitRequest:
    import msgspec

    return msgspec.structs.replace(q, cost_hint=cost, request_id=f"rlqs-{secrets.token_hex(10)}")


async def take(decide: Decide, q: AdmitRequest, want: int) -> Taken:
    """Take up to ``want`` tokens for the bucket of ``q``: one decision of that cost; a denial that
    says fewer are left is asked again for what is left, then half of that (partial chunks).

    A **held** denial with nothing more to ask is probed with one token (once a round): the agent's
    negative cache denies the same key and cost for the whole of an exact hint (the time until the
    whole cost is back: seconds for a bucket's burst), with the remaining of when it was made, while
    tokens may have returned since. The probe is another cost, so it asks the store; admitted, it
    says what is left, and one more attempt takes that too. Without it, a round of a bucket far
    above its limit got nothing while the hold lasted, and what the rule refilled meanwhile waited
    for the hold's end (lost when its demand ended first). A denial the store made is not probed:
    its remaining is current."""
    want = max(1, min(MAX_COST, want))
    cost = want
    got = 0
    probing = probed = False
    last: Decision | None = None
    asked: list[int] = []
    limit = ROUND_ATTEMPTS
    while len(asked) < limit:
        (d,) = await decide([with_cost(q, cost)])
        asked.append(cost)
        last = d
        if d.allowed:
            got += cost
            more = min(want - got, d.remaining or 0)
            if not probing or more < 1:
                return Taken(got, d, tuple(asked))
            cost, probing = more, False  # the probe passed: what it says is left, up to the want
            continue
        if got:  # what the probe said was left went meanwhile: keep the probe's token
            return Taken(got, d, tuple(asked))
        if d.http_status != 429:
            break  # not a limit: a closed rule without its store, a conflict, the agent overloaded
        left = d.remaining or 0
        if d.retry_after_ms < 0:  # never at this cost (above a rule's capacity): half of it may pass
            left = max(left, cost // 2)
        nxt = min(cost - 1, left) if len(asked) == 1 else min(cost - 1, left, cost // 2)
        if nxt < 1 and not probed and cost > 1 and d.source == DecisionSource.NEGATIVE_CACHE:
            nxt, probing, probed = 1, True, True  # a held denial: a token may have returned since
            limit = len(asked) + 2  # the probe, and what it says is left
        if nxt < 1 or len(asked) >= limit:
            break
        cost = nxt
    return Taken(got, last, tuple(asked))


def share(tokens: int, needs: dict[Holding, int]) -> dict[Holding, int]:
    """The round's ``tokens`` among its parties by demand (:func:`kernel.fair_share.split`), each
    party's rounding carried on its holding (``owed``) to its next round."""
    gives, owed = split(tokens, needs, {h: h.demand for h in needs}, {h: h.owed for h in needs})
    for h, o in owed.items():
        h.owed = o
    return gives


__all__ = ["Decide", "Holding", "Taken", "demand_after", "ended", "granted", "need", "needs_end", "next_check_ms", "observe", "own_rate",
           "renew_at_ms", "renewal_ttl", "renewed", "revoke", "runs_short", "share", "silent", "take", "waiting", "wants_tokens", "with_cost"]
