"""The negative cache as a decision uses it (the cache itself: region_agent.negcache): a request
whose question met a held denial is answered from it before any store call; a store denial is
remembered for the question it answered; an answer that was not a store denial ends it.

**A held denial answers only the rule set it was given for.** Its key is the request's whole
call — every slot's key, kind and parameters — not the denying slot's key alone: the script's
hint is the longest over *all* denying rules (a user bucket refilling in 1 s and a tenant bucket
in 30 s give 30 s), so a request sharing the user key but not the tenant rule (the same user on
another route) must not be denied for the tenant rule's 30 s. For the same rule set the hint is
exact (nothing but time makes the same call pass), so the hold is the whole hint (capped: see
region_agent.negcache). The cost: requests of *different* rule sets that meet the same exhausted
key (many users of one exhausted tenant) each ask the store once per hold instead of sharing one
entry.

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
        """The held denial of ``plan``'s question (its hint counted from now), or None.
        ``now_ms``: the clock's reading, when the caller has one (a batch reads it once)."""
        entries = self.cache.entries
        if plan.decision_ttl_ms > 0 or not entries or not plan.calls:
            return None
        key = tuple(plan.calls)
        if key not in entries:
            return None
        if now_ms is None:
            now_ms = self.now_ms()
        hit = self.cache.get(key, now_ms)
        if hit is None:
            return None
        self._hits += 1
        a: Answer = hit.payload
        # built directly: NamedTuple._replace was a tenth of a cached denial's cost
        return Answer(a.allowed, a.rule, a.scope, a.reason, a.limit, a.remaining,
                      max(1, int(hit.retry_at_ms - now_ms + 0.999)), a.fallback)

    def remember(self, plan: Plan, slot: int, answer: Answer, *, calls: Sequence[Call] | None = None,
                 fallback: bool = False) -> None:
        """Hold the store's denial ``answer`` (by slot ``slot`` of the call sent: ``calls``, when
        they differ from the plan's) for ``plan``'s question. A bucket's or window's hint is exact
        when every rule of the call has exact hints; a pool's (a top-up) or a fallback
        allowance's is not."""
        if not plan.calls:
            return
        exact = not fallback and all(s.rule.exact_hint for s in plan.slots)
        self.cache.put(tuple(plan.calls), self.now_ms(), answer.retry, answer, exact=exact)

    def forget(self, plan: Plan, calls: Sequence[Call] | None = None) -> None:
        """Drop the held denial of a request that got past the negative cache (none was running:
        an entry it met was a probe). Its answer was not a store denial - an admission, or the
        local fallback's decision while the store is lost - so the old denial must not answer the
        others (as a store decision, with an elapsed hint) while the probe's hold lasts.
        ``calls``: what was sent in place of the plan's calls (the hold is keyed by the plan's)."""
        entries = self.cache.entries
        if not entries or plan.decision_ttl_ms or not plan.calls:
            return
        self.cache.forget(tuple(plan.calls))
