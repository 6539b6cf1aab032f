"""Funding Envoys' quota assignments (region_agent.leasing.rlqs_funding): demand from reports,
when a holding needs tokens, partial chunks, renewals that never add tokens, stranded counting."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from kernel.algorithms.pool import PoolRule
from kernel.algorithms.token_bucket import TokenBucketRule
from region_agent.leasing import rlqs_funding as f
from region_agent.models import AdmitRequest, Decision, DecisionSource, Principal

Q = AdmitRequest(request_id="rlqs-bucket", principal=Principal(type="user", id="U-1"), route_group="read",
                 tenant_id="atlas")


def holding(**kw) -> f.Holding:
    return f.Holding(stream=1, bucket=(("tenant", "atlas"),), question=Q, **kw)


def test_demand_is_averaged_alike_above_and_below_and_a_change_is_taken_at_once():
    h = holding()
    f.observe(h, 0, 1, 1_000.0, 5_000)  # a new bucket's first request: about 1 per second
    assert h.demand == 1.0
    f.observe(h, 30, 20, 6_000.0, 5_000)  # 50 in 5 s: far beyond the noise of 5 expected, a rise
    assert h.demand == 10.0 and h.allowed == 30 and h.denied == 21
    f.observe(h, 0, 0, 11_000.0, 5_000)  # none where 50 were expected: a fall, as fast as the rise
    assert h.demand == 0.0 and h.last_traffic_ms == 6_000.0
    # noise about an average of 4/s moves it alike up and down (the old average rose at once and
    # fell by half the gap: biased up)
    up, down = holding(), holding()
    for x in (up, down):
        f.observe(x, 0, 20, 5_000.0, 5_000)  # first on a new stream: an interval's worth
        assert x.demand == 4.0
    f.observe(up, 26, 0, 10_000.0, 5_000)
    f.observe(down, 14, 0, 10_000.0, 5_000)
    assert 4.0 < up.demand < 5.2 and math.isclose(up.demand - 4.0, 4.0 - down.demand)


def test_a_first_report_of_more_than_one_request_counts_over_one_interval():
    """Envoy reports a bucket it has just made at once, with its first request: one request, taken
    as one a second until the next report says more. A bucket Envoy already had is first reported
    on a new stream (the agent restarted) in Envoy's periodic report: one interval's requests —
    20 of them are 4 a second, not 20 (the tokens for 20 a second would be stranded)."""
    new_bucket, new_stream = holding(), holding()
    f.observe(new_bucket, 1, 0, 1_000.0, 5_000)
    f.observe(new_stream, 12, 8, 1_000.0, 5_000)
    assert (new_bucket.demand, new_stream.demand) == (1.0, 4.0)
    f.observe(new_bucket, 12, 0, 4_000.0, 5_000)  # the next report: 12 in the 3 s since the first
    assert new_bucket.demand == 4.0
    quiet = holding()
    f.observe(quiet, 0, 0, 1_000.0, 5_000)  # reported with no request: no demand
    assert quiet.demand == 0.0


def poisson_reports(rate: float, seed: int, n: int) -> list[tuple[float, int]]:
    """(report time ms, requests since the last report) of a Poisson process of ``rate`` per
    second, reported every 5 s with up to 50 ms of jitter."""
    rnd = random.Random(seed)
    t_next = rnd.expovariate(rate)
    out, at = [], 0.0
    for _ in range(n):
        at += 5.0 + rnd.uniform(-0.05, 0.05)
        count = 0
        while t_next <= at:
            count += 1
            t_next += rnd.expovariate(rate)
        out.append((at * 1000.0, count))
    return out


@pytest.mark.parametrize(("rate", "seed"), [(4.0, 1), (4.0, 2), (1.0, 3), (20.0, 4)])
def test_the_demand_of_poisson_traffic_averages_its_rate_and_less_noisy_than_one_report(rate, seed):
    """Unbiased (within 3 % over 2000 reports), and steadier than the report it averages."""
    h = holding()
    h.last_report_ms = 1.0  # reporting for a while already
    h.requests_avg, h.seconds_avg = rate * 5, 5.0
    estimates, single = [], []
    last = 0.0
    for at, count in poisson_reports(rate, seed, 2_000):
        f.observe(h, count, 0, at, 5_000)
        estimates.append(h.demand)
        single.append(count / ((at - last) / 1000.0))
        last = at
    assert abs(statistics.fmean(estimates) / rate - 1) < 0.03, statistics.fmean(estimates)
    assert statistics.pstdev(estimates) < 0.75 * statistics.pstdev(single)


def test_a_genuine_rise_is_funded_from_its_first_report():
    h = holding()
    f.observe(h, 20, 0, 5_000.0, 5_000)
    f.observe(h, 40, 0, 10_000.0, 5_000)  # twice the demand: 20 beyond 20 expected (3 deviations: 14)
    assert h.demand == 8.0
    f.observe(h, 48, 0, 15_000.0, 5_000)  # within the noise of 40: averaged
    assert 8.0 < h.demand < 9.6


def test_need_is_one_interval_of_demand_within_one_and_the_cap():
    assert f.need(holding(demand=2.0), 6_000, 100) == 12
    assert f.need(holding(demand=0.01), 6_000, 100) == 1
    assert f.need(holding(demand=500.0), 6_000, 100) == 100


def test_need_stops_at_the_end_of_the_time_to_live_it_is_sent_with():
    """2 s to live (the window ends in 2.5 s; Envoy counts whole seconds): 2 s of demand, not a whole
    interval's nor the window's 2.5 s (the rest would be stranded)."""
    assert f.need(holding(demand=4.0), 6_000, 100, ttl_ms=2_000) == 8
    assert f.need(holding(demand=4.0), 6_000, 100, ttl_ms=10_000) == 24  # lives longer: one interval
    assert f.need(holding(demand=4.0), 6_000, 100, ttl_ms=0) == 1


def test_after_a_report_of_4_a_second_an_assignment_of_5_s_carries_20_tokens():
    h = holding()
    f.observe(h, 0, 20, 5_000.0, 5_000)
    assert f.need(h, 6_000, 100, ttl_ms=5 * 1_000) == 20  # not 23 (sized by a clamp 5.65 s away)


def user_bucket(scope: str = "user", refill_per_s: int = 2) -> TokenBucketRule:
    """20 tokens, then ``refill_per_s`` a second (Figure 8's P-READ)."""
    return TokenBucketRule(id=f"{scope}-read", scope=scope, fail_mode="closed", capacity_millis=20_000,
                           refill_millis=refill_per_s * 1_000, period_ms=1_000, cost_millis=1_000)


def test_a_bucket_of_its_principals_own_rules_has_their_slowest_refill_and_a_shared_one_none():
    assert f.own_rate([user_bucket()], {}, "user") == 2.0
    assert f.own_rate([user_bucket("user", 5), user_bucket("key", 3)], {}, "user") == 3.0
    # shared with other principals: a tenant's or a route's rule, a pool
    assert f.own_rate([user_bucket(), user_bucket("tenant", 50)], {}, "user") == 0.0
    assert f.own_rate([user_bucket("route")], {}, "user") == 0.0
    assert f.own_rate([user_bucket(), PoolRule(id="p", scope="user", fail_mode="closed", pool="atlas-w")],
                      {}, "user") == 0.0
    assert f.own_rate([user_bucket()], {}, "anonymous") == 0.0
    assert f.own_rate([], {}, "user") == 0.0


def test_an_own_rules_bucket_is_funded_at_least_its_refill_whatever_the_first_report_said():
    """A new bucket's first report is one request (taken as one a second): its demand above that is
    unknown until Envoy's next report, 5 s on, while the user's rule (20, then 2 a second) would sit
    full and lose its refill. The assignment carries the refill over the span instead."""
    h = holding()
    f.observe(h, 0, 1, 1_000.0, 5_000)
    assert h.demand == 1.0
    assert f.need(h, 6_000, 100, ttl_ms=10_000) == 6  # a shared bucket: its demand
    assert f.need(h, 6_000, 100, ttl_ms=10_000, own_rate=2.0) == 12  # its own rule's refill over 6 s
    assert f.need(h, 6_000, 100, ttl_ms=3_000, own_rate=2.0) == 6  # over the time to live when shorter
    assert f.need(holding(demand=5.0), 6_000, 100, own_rate=2.0) == 30  # the demand when above it
    assert f.need(holding(demand=5.0), 6_000, 10, own_rate=20.0) == 10  # the cap still holds


def test_a_holding_wants_tokens_when_its_assignment_is_gone_or_nearly_spent():
    h = holding(demand=2.0)
    assert f.wants_tokens(h, 0.0, 300)
    f.granted(h, 12, 10, 0.0, f.INF)
    assert not f.wants_tokens(h, 1_000.0, 300)  # 10 of 12 left by the demand
    h.last_report_ms = 1_000.0
    assert not f.wants_tokens(h, 6_000.0, 300)  # predicted: 12 - 2/s x 5 s = 2 left
    assert f.wants_tokens(h, 6_600.0, 300)  # about one token left: the next assignment now
    h.retry_at_ms = 9_000.0
    assert not f.wants_tokens(h, 6_600.0, 300)  # a denied round holds it back
    assert not f.wants_tokens(holding(demand=0.0), 0.0, 300)
    assert not f.wants_tokens(f.Holding(stream=1, bucket=(), question=None, refused="unknown_key", demand=5), 0, 300)


def test_a_silent_holding_wants_no_tokens_and_is_not_checked_at_its_predicted_run_out():
    h = holding(demand=4.0, last_report_ms=10_000.0)
    f.granted(h, 20, 20, 10_000.0, math.inf)
    at = 15_000.0  # 20 tokens at 4 a second: predicted spent
    assert f.wants_tokens(h, at, 300.0, quiet_ms=6_000.0)
    assert f.next_check_ms(h, at, 300.0, quiet_ms=6_000.0) == at
    later = 16_500.0  # one report interval and a grace (6 s) since its last report: silent
    assert f.silent(h, later, 6_000.0) and not f.wants_tokens(h, later, 300.0, quiet_ms=6_000.0)
    assert f.next_check_ms(h, later, 300.0, quiet_ms=6_000.0) == 20_000.0  # its renewal's turn, not now
    h.short_at_ms = later - 1_000.0
    assert not f.waiting(h, later, 6_000.0, 300.0, quiet_ms=6_000.0)
    f.observe(h, 20, 5, 17_000.0, 5_000)  # it reports again
    assert f.wants_tokens(h, 17_000.0, 300.0, quiet_ms=6_000.0)


def test_a_renewal_adds_time_never_tokens_and_never_passes_the_clamp():
    h = holding(demand=1.0)
    f.granted(h, 10, 10, 0.0, 12_000.0)
    assert f.renewal_ttl(h, 3_000.0, 10) == 0  # more than half the time to live left
    assert f.renewal_ttl(h, 6_000.0, 10) == 6  # clamp at 12 s: 6 s from now
    f.renewed(h, 6, 6_000.0)
    assert h.chunk == 10 and h.funded == 10 and h.expires_at_ms == 12_000.0
    assert f.renewal_ttl(h, 10_000.0, 10) == 0  # would not extend past the clamp
    h2 = holding(demand=1.0)
    f.granted(h2, 3, 10, 0.0, f.INF)
    h2.used = 3
    assert f.renewal_ttl(h2, 6_000.0, 10) == 0  # nothing left to renew


def test_a_renewal_is_sent_only_while_it_arrives_before_envoys_own_expiry():
    """A renewal Envoy receives after its own time to live of the assignment ran out starts the
    token bucket full. Envoy's time to live ends no sooner than the agent's (it started on
    arrival), and nothing sent arrives later than ``delivery_ms`` (the shipped Envoy's keepalive),
    so a renewal is sent only while the assignment has longer than that to live: due at half its
    time to live, or ``delivery_ms`` and a lead before its end when that comes first; never
    within ``delivery_ms`` of it."""
    h = holding(demand=1.0)
    f.granted(h, 10, 10, 0.0, 30_000.0)  # 10 s: due at 5 s left, which is more than 2.5 s
    assert f.renew_at_ms(h, 2_500.0) == 5_000.0
    assert f.renewal_ttl(h, 4_999.0, 10, 2_500.0) == 0 and f.renewal_ttl(h, 5_000.0, 10, 2_500.0) == 10
    assert f.renewal_ttl(h, 7_499.0, 10, 2_500.0) == 10
    assert f.renewal_ttl(h, 7_500.0, 10, 2_500.0) == 0  # 2.5 s left: it could arrive after Envoy's expiry
    assert f.renewal_ttl(h, 7_500.0, 10, 0.0) == 10  # without a delivery bound: the last moment is the expiry
    h3 = holding(demand=1.0)
    f.granted(h3, 10, 4, 0.0, 30_000.0)  # 4 s: half of it is less than 2.5 s and the 300 ms lead
    assert f.renew_at_ms(h3, 2_500.0) == 4_000.0 - 2_800.0
    assert f.renewal_ttl(h3, 1_199.0, 10, 2_500.0) == 0 and f.renewal_ttl(h3, 1_200.0, 10, 2_500.0) == 10
    assert f.renewal_ttl(h3, 1_500.0, 10, 2_500.0) == 0
    assert f.next_check_ms(h3, 0.0, 0.0, delivery_ms=2_500.0) == 1_200.0
    h4 = holding(demand=1.0)
    f.granted(h4, 10, 2, 0.0, 30_000.0)  # 2 s: never renewed (a fresh assignment follows it)
    assert all(f.renewal_ttl(h4, t, 10, 2_500.0) == 0 for t in range(0, 2_000, 100))


def test_an_assignment_that_runs_out_unreplaced_is_ended_once():
    """Envoy times an assignment from when it arrives: one delivered late (a stalled stream) would
    outlive the window its tokens came from. Once its time to live has run out as the agent counts
    it, the agent ends it explicitly -- whether or not Envoy reported meanwhile -- and only once."""
    h = holding(demand=1.0)
    assert not f.needs_end(h, 0.0)  # nothing sent yet
    f.granted(h, 6, 5, 100.0, 5_650.0)  # 5 s, sent 100 ms into a 6 s window (clamp 250 ms before its end)
    assert not f.needs_end(h, 5_099.0)
    assert f.needs_end(h, 5_100.0)  # no report since: a stalled stream is the case that matters
    f.ended(h, 5_120.0)
    assert not f.needs_end(h, 5_200.0) and not h.live(5_120.0)
    assert f.renewal_ttl(h, 5_120.0, 10) == 0  # never a renewal after an end: it would refill the bucket


def test_a_fresh_assignment_or_a_renewal_moves_the_end_and_a_revocation_is_one():
    h = holding(demand=1.0)
    f.granted(h, 10, 10, 0.0, 12_000.0)
    f.renewed(h, 6, 6_000.0)  # now 12 s
    assert not f.needs_end(h, 11_999.0) and f.needs_end(h, 12_000.0)
    f.granted(h, 4, 5, 11_000.0, 17_000.0)  # replaced before it ran out: that one needs no end of its own
    assert not f.needs_end(h, 15_999.0) and f.needs_end(h, 16_000.0)
    f.revoke(h, 13_000.0)  # a revocation is a DENY_ALL already
    assert not f.needs_end(h, 16_000.0)


def test_stranded_tokens_are_what_was_funded_and_not_used_once_it_cannot_be_used():
    h = holding(demand=1.0)
    f.granted(h, 10, 5, 0.0, f.INF)
    h.last_report_ms = 1_000.0
    f.observe(h, 4, 0, 2_000.0, 5_000)  # 4 in the second since Envoy's last report
    assert h.settle(2_000.0) == 0  # 6 may still be spent
    f.granted(h, 8, 5, 2_500.0, f.INF)  # a fresh one replaces it: its leftover is abandoned
    # the report counts 3: about 2 of them (4/s for 0.5 s) spent from the old one before the new arrived
    f.observe(h, 3, 0, 7_000.0, 5_000)
    assert h.settle(7_100.0) == 4  # the old one's leftover: 10 - 4 - 2
    assert h.settle(8_000.0) == 7 and h.stranded == 18 - 7  # the new one expired at 7.5 s: all unused is stranded
    assert h.settle(9_000.0) == 0


HELD = DecisionSource.NEGATIVE_CACHE


def decisions(*answers: tuple):
    """A scripted admission: (allowed, remaining, retryAfterMs[, source]) per call; records the costs
    asked."""
    asked: list[int] = []
    it = iter(answers)

    async def decide(qs):
        (q,) = qs
        asked.append(q.cost_hint)
        ok, rem, retry, *source = next(it)
        return [Decision(allowed=ok, decision_id=q.request_id, rule_id="read-user-v3", bundle_version=1,
                         remaining=rem, retry_after_ms=retry, http_status=200 if ok else 429,
                         source=source[0] if source else DecisionSource.SCRIPT)]
    return decide, asked


def test_take_asks_again_for_what_a_denial_says_is_left():
    decide, asked = decisions((False, 6, 500), (True, 0, 0))
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, asked) == (6, [20, 6])
    decide, asked = decisions((False, 6, 500), (False, 3, 500), (True, 0, 0))
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, asked) == (3, [20, 6, 3])
    decide, asked = decisions((False, 0, 800))  # none left, as the store says: nothing more asked
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, t.retry_ms, asked) == (0, 800, [20])
    decide, asked = decisions((False, 0, -1), (True, 3, 0))  # never at 40 (above a capacity): half
    assert asyncio.run(f.take(decide, Q, 40)).tokens == 20
    assert all(q.startswith("rlqs-") for q in [f.with_cost(Q, 3).request_id])


def test_a_denial_that_says_none_is_left_is_probed_with_one_token_and_what_that_says_is_left_is_taken():
    """The negative cache holds a denial of the same cost for its whole exact hint (seconds, for a
    user's bucket to be back at 20), with the remaining of when it was made (0): a round of a bucket
    far above its limit got nothing while its rule refilled. One token asks the store; its answer
    says how many more are there."""
    decide, asked = decisions((False, 0, 4_000, HELD), (True, 5, 0), (True, 0, 0))
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, asked, t.attempts) == (6, [20, 1, 5], 3)
    decide, asked = decisions((False, 0, 4_000, HELD), (True, 0, 0))  # the probe was the last token
    assert (asyncio.run(f.take(decide, Q, 20)).tokens, asked) == (1, [20, 1])
    decide, asked = decisions((False, 0, 4_000, HELD), (True, 5, 0), (False, 2, 300))  # the 5 went meanwhile
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, t.retry_ms, asked) == (1, 0, [20, 1, 5])
    decide, asked = decisions((False, 0, 4_000, HELD), (True, 50, 0), (True, 0, 0))  # never more than the want
    assert (asyncio.run(f.take(decide, Q, 20)).tokens, asked) == (20, [20, 1, 19])
    decide, asked = decisions((False, 0, 4_000, HELD), (False, 0, 500))  # nothing returned yet
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, t.retry_ms, asked) == (0, 500, [20, 1])
    decide, asked = decisions((False, 0, 800, HELD))  # a token asked: nothing smaller to probe with
    assert (asyncio.run(f.take(decide, Q, 1)).tokens, asked) == (0, [1])
    # a held denial's remaining is of when it was made: 3 then, and 3 is held too; 4 are back now
    decide, asked = decisions((False, 3, 8_000, HELD), (False, 0, 100, HELD), (True, 3, 0), (True, 0, 0))
    t = asyncio.run(f.take(decide, Q, 20))
    assert (t.tokens, asked) == (4, [20, 3, 1, 3])
    decide, asked = decisions((False, 6, 500), (False, 0, 500))  # the store's own answers: no probe
    assert (asyncio.run(f.take(decide, Q, 20)).tokens, asked) == (0, [20, 6])


def test_take_stops_at_an_answer_that_is_not_a_limit():
    async def closed(qs):
        (q,) = qs
        return [Decision(allowed=False, decision_id=q.request_id, rule_id="x", bundle_version=1, remaining=50,
                         retry_after_ms=5_000, http_status=503)]
    t = asyncio.run(f.take(closed, Q, 20))
    assert t.tokens == 0 and t.attempts == 1 and t.retry_ms == 5_000


def test_share_is_by_demand_and_carries_each_holdings_rounding():
    a, b = holding(demand=9.0), holding(demand=3.0)
    assert f.share(20, {a: 20, b: 20}) == {a: 15, b: 5}
    assert f.share(40, {a: 20, b: 20}) == {a: 20, b: 20}
    assert f.share(1, {a: 20, b: 20}) == {a: 1, b: 0} and (a.owed, b.owed) == (-0.25, 0.25)
    assert f.share(1, {a: 20, b: 20}) == {a: 1, b: 0} and b.owed == 0.5
    assert f.share(1, {a: 20, b: 20}) == {a: 0, b: 1}  # b's quarter of three tokens: one whole token


def test_a_short_envoy_waits_until_funded_in_full_and_a_denial_hint_does_not_hold_it_back():
    """Short: a round within one span gave it less than it asked, and its assignment runs out.
    It joins the rounds other Envoys of its bucket start, whatever its own retry time."""
    h = holding(demand=8.0)
    assert not f.waiting(h, 1_000.0, 6_000, 300)  # never short
    h.short_at_ms, h.retry_at_ms = 1_000.0, 2_000.0
    assert f.waiting(h, 1_500.0, 6_000, 300) and not f.wants_tokens(h, 1_500.0, 300)
    assert not f.waiting(h, 7_001.0, 6_000, 300)  # short longer ago than one span: its own rounds ask
    f.granted(h, 40, 10, 1_500.0, f.INF)
    assert not f.waiting(h, 1_600.0, 6_000, 300)  # holds tokens for a while: not waiting
    assert not f.waiting(holding(demand=0.0, short_at_ms=1_000.0), 1_500.0, 6_000, 300)  # no demand


