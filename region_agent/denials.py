"""The negative cache as a decision uses it (the cache itself: region_agent.negcache): a request
whose slots met a held denial is answered from it before any store call; a store denial is
remembered by the slot that denied; an answer that was not a store denial ends the held ones.

Only requests without a decision record take part (a record's replay must come from the store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .call import Call
from .metrics import AgentMetrics
from .negcache import NegativeCache
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
        """The held denial one of ``plan``'s slots meets (its hint counted from now), or None.
        ``now_ms``: the clock's reading, when the caller has one (a batch reads it once)."""
        entries = self.cache.entries
        if plan.decision_ttl_ms > 0 or not entries:
            return None
        for call in plan.calls:
            key = (call.key, call.params)
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
        """Hold the store's denial ``answer`` by slot ``slot`` of the call (``calls``: its slots,
        when they differ from the plan's). A bucket's or window's hint is exact; a pool's (a top-up)
        or a fallback allowance's is not."""
        call = (calls or plan.calls)[slot]
        self.cache.put((call.key, call.params), self.now_ms(), answer.retry, answer,
                       exact=plan.slots[slot].rule.exact_hint and not fallback)

    def forget(self, plan: Plan, calls: Sequence[Call] | None = None) -> None:
        """Drop the cached denials of a request that got past the negative cache (none of its holds
        was running: an entry it met was a probe). Its answer was not a store denial - an admission,
        or the local fallback's decision while the store is lost - so the old denial must not answer
        the others (as a store decision, with an elapsed hint) while the probe's hold lasts."""
        entries = self.cache.entries
        if not entries or plan.decision_ttl_ms:
            return
        for call in plan.calls:
            key = (call.key, call.params)
            if key in entries:
                self.cache.forget(key)
        for call in calls or ():  # e.g. a pool rule's fallback allowance in place of its balance
            self.cache.forget((call.key, call.params))
