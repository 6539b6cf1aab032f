"""The negative cache as a decision uses it (the cache itself: region_agent.decision.negcache): a request
whose question met a held denial is answered from it before any store call; a store denial is
remembered for the question it answered; an answer that was not a store denial ends it.

**A denial is held in two ways.** For the request's whole call — every slot's key, kind and
parameters — with the script's hint: for the same rule set the hint is exact (nothing but time
makes the same call pass), so the hold is the whole hint (capped: region_agent.decision.negcache). And on
the denying slot's own key, for at most the cache's cap (``--negative-cache-ms``, 250 ms) and
with a hint no longer than that: the script's hint is the longest over *all* denying rules (a
user bucket refilling in 1 s and a tenant bucket in 30 s give 30 s), so a request that shares
that key but not the other rule (the same user on another route) must never be denied for the
other rule's 30 s — it is denied locally for at most 250 ms and then asks the store, while a
flood of many rule sets against one exhausted key (many users of an exhausted tenant) still
costs the shard one call per 250 ms, not one per attempt.

Only requests without a decision record take part (a record's replay must come from the store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..service.metrics import AgentMetrics
from .call import Call
from .negcache import NegativeCache, denial_keys
from .outcome import Answer
from .plan import Plan


class Denials:
    def __init__(self, cache: NegativeCache, metrics: AgentMetrics, now_ms: Callable[[], float]):
        self.cache = cache
        self.metrics = metrics
        self.now_ms = now_ms  # monotonic milliseconds
        self._hits = 0  # since the last collection (moved into the counter then: AgentMetrics.add_flush)
        metrics.add_flush(self._flush)

    def _flush(self) -> None:
        if self._hits:
            self.metrics.negative_hits.inc(self._hits)
            self._hits = 0

    def hit(self, plan: Plan, now_ms: float | None = None) -> Answer | None:
        """The held denial ``plan``'s question meets (its hint counted from now), or None: first
        the denial of this very rule set, then a short hold on one of its keys (module doc).
        ``now_ms``: the clock's reading, when the caller has one (a batch reads it once)."""
        entries = self.cache.entries
        if plan.decision_ttl_ms > 0 or not entries:
            return None
        # built once when its question was remembered (region_agent.decision.plan), else here
        for key in plan.denial_keys or denial_keys(plan.calls):
            if key not in entries:
                continue
            if now_ms is None:
                now_ms = self.now_ms()
            hit = self.cache.get(key, now_ms)
            if hit is not None:
                self._hits += 1
                a: Answer = hit.payload
                # built directly: NamedTuple._replace was a tenth of a cached denial's cost
                return Answer(a.allowed, a.rule, a.scope, a.reason, a.limit, a.remaining,
                              max(1, int(hit.retry_at_ms - now_ms + 0.999)), a.fallback)
        return None

    def remember(self, plan: Plan, slot: int, answer: Answer, *, calls: Sequence[Call] | None = None,
                 fallback: bool = False) -> None:
        """Hold the store's denial ``answer`` (by slot ``slot`` of the call sent: ``calls``, when
        they differ from the plan's): for ``plan``'s whole rule set with its hint (exact when every
        rule of the call has exact hints; a pool's or a fallback allowance's is not), and on the
        denying slot's own key for the cache's cap at most, with a hint no longer than that."""
        if not plan.calls:
            return
        now = self.now_ms()
        exact = not fallback and all(s.rule.exact_hint for s in plan.slots)
        self.cache.put(tuple(plan.calls), now, answer.retry, answer, exact=exact)
        call = (calls or plan.calls)[slot]
        short = min(answer.retry, self.cache.cap_ms)
        self.cache.put((call.key, call.params), now, short, answer._replace(retry=short), exact=False)

    def forget(self, plan: Plan, calls: Sequence[Call] | None = None) -> None:
        """Drop the held denials of a request that got past the negative cache (none was running:
        an entry it met was a probe). Its answer was not a store denial - an admission, or the
        local fallback's decision while the store is lost - so the old denial must not answer the
        others (as a store decision, with an elapsed hint) while the probe's hold lasts.
        ``calls``: what was sent in place of the plan's calls."""
        entries = self.cache.entries
        if not entries or plan.decision_ttl_ms:
            return
        if plan.calls:
            self.cache.forget(tuple(plan.calls))
        for call in plan.calls:
            key = (call.key, call.params)
            if key in entries:
                self.cache.forget(key)
        for call in calls or ():  # e.g. a pool rule's fallback allowance in place of its balance
            self.cache.forget((call.key, call.params))
