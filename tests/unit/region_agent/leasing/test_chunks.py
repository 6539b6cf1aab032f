"""A fleet-wide pool's in-process chunk (region_agent/leasing/chunks.py): spending, give-backs,
parts kept across renewals, and chunks sized by their holder's demand."""

from hypothesis import given
from hypothesis import strategies as st

from region_agent.leasing.chunks import (
    MAX_EMPTY_PARTS,
    MAX_PARTS,
    SPEND_SHARE,
    Chunk,
    RecentDemand,
    chunk_size,
    tokens_per_s,
)


def test_chunk_lease_spend_give_back_expiry():
    lease = Chunk()
    assert lease.try_take(1, 0) is None
    lease.grant(100, now_ms=0, validity_ms=250)
    part = lease.try_take(1, 10)
    assert part is not None and lease.usable(10) == 99
    assert lease.give_back(1, part.generation, 20, 250) and lease.usable(20) == 100
    assert lease.try_take(1, 250) is None  # expired: unspent tokens abandoned
    lease.grant(10, now_ms=300, validity_ms=250)
    assert not lease.give_back(1, part.generation, 310, 250)  # its part is gone: never lands in another
    assert lease.usable(310) == 10
    assert lease.deny(400, 1_000, 250) == 250 and lease.negative(500) and not lease.negative(650)
    # held at most hold_ms, answered with the hint: min(1,000, the validity)
    assert lease.deny(700, 1_000, 250, hold_ms=100) == 250 and lease.negative(799) and not lease.negative(800)
    assert lease.retry_ms(760) == 190
    lease.deny(900, 1_000, 250, hold_ms=0)  # 0: no local denial at all
    assert not lease.negative(900)


def test_a_renewal_keeps_what_the_chunk_still_holds():
    """A reservation given back while a renewal was in flight is not abandoned by the renewal: it
    stays in its own part (its own validity), spent before the newer part."""
    lease = Chunk()
    lease.grant(2, now_ms=0, validity_ms=1_000)
    a, b = lease.try_take(1, 10), lease.try_take(1, 10)
    assert a is not None and b is not None and lease.usable(10) == 0  # empty: a renewal starts
    assert lease.give_back(1, a.generation, 20, 1_000)  # a's request was denied by another rule
    lease.grant(5, now_ms=30, validity_ms=1_000)  # the renewal lands
    assert lease.usable(40) == 6
    first = lease.try_take(1, 40)
    assert first is not None and first.generation == a.generation  # the earlier-expiring part first
    assert lease.usable(40) == 5
    assert lease.usable(1_000) == 5  # the old part ended with its own validity, the new one holds
    assert lease.give_back(1, b.generation, 1_010, 1_000) is False  # b's part is gone: nothing lands
    assert lease.usable(1_010) == 5


def test_parts_are_bounded_and_empty_ones_kept_only_until_they_expire():
    lease = Chunk()
    for i in range(MAX_PARTS + 3):
        lease.grant(1, now_ms=i, validity_ms=1_000)
    assert len(lease.parts) == MAX_PARTS and lease.usable(10) == MAX_PARTS
    assert lease.take_abandoned() == 3  # the earliest-expiring parts beyond MAX_PARTS
    while lease.try_take(1, 10):
        pass
    lease.grant(3, now_ms=11, validity_ms=1_000)
    assert lease.usable(11) == 3 and [p.tokens for p in lease.parts if p.tokens] == [3]
    assert len(lease.parts) <= MAX_PARTS + MAX_EMPTY_PARTS
    for i in range(3 * MAX_EMPTY_PARTS):  # spent and renewed again and again: the empty parts are bounded
        lease.grant(1, now_ms=20 + i, validity_ms=1_000)
        assert lease.try_take(1, 20 + i) is not None
    assert lease.usable(40) == 3 and len(lease.parts) <= MAX_PARTS + MAX_EMPTY_PARTS
    lease.grant(1, now_ms=1_100, validity_ms=1_000)  # every earlier part has expired
    assert [p.tokens for p in lease.parts] == [1] and lease.take_abandoned() == 3


def test_a_reservation_given_back_after_a_renewal_lands_in_its_own_part():
    """The last token of a part is out on a reservation (its request is waiting for its tenant
    script) when another request finds the chunk empty and renews it. The renewal must not drop the
    emptied part: the reservation's request is then denied by its own tenant rule and the token comes
    back. Dropped, it was lost: debited from the regional balance, so its lease reported it spent and
    the allocator never granted it again, yet never admitted (a fleet-wide pool's fault-free window
    ended with 96 of G 100 admitted while 148 tokens were asked)."""
    lease = Chunk()
    lease.grant(2, now_ms=0, validity_ms=1_000)
    spent = lease.try_take(1, 10)
    out = lease.try_take(1, 20)  # the last token, reserved by a request another rule will deny
    assert spent is not None and out is not None and lease.usable(20) == 0
    lease.grant(3, now_ms=30, validity_ms=1_000)  # the renewal an empty chunk starts lands first
    assert lease.give_back(1, out.generation, 35, 1_000)  # the denied request's token comes back
    assert lease.usable(35) == 4 and lease.take_abandoned() == 0
    first = lease.try_take(1, 40)
    assert first is not None and first.generation == out.generation  # spent first: it expires first
    assert lease.usable(1_000) == 3 and lease.take_abandoned() == 0  # its part ended empty: nothing lost


def test_a_reservation_given_back_after_its_part_expired_is_counted_abandoned():
    lease = Chunk()
    lease.grant(1, now_ms=0, validity_ms=100)
    out = lease.try_take(1, 90)
    assert out is not None
    assert not lease.give_back(1, out.generation, 120, 100)  # its request was decided too late
    assert lease.take_abandoned() == 1  # bought, reported spent by its lease, never admitted


def test_fallback_is_per_part():
    lease = Chunk()
    lease.grant(1, now_ms=0, validity_ms=1_000, fallback=True)
    lease.grant(1, now_ms=0, validity_ms=2_000)
    a, b = lease.try_take(1, 1), lease.try_take(1, 1)
    assert a is not None and b is not None and (a.fallback, b.fallback) == (True, False)


def test_recent_demand_counts_the_last_quarter_and_the_whole_span():
    d = RecentDemand()
    span = 1_000
    d.note(0, 10_000, span)  # the span is set (a policy's chunk validity)
    for t in range(0, 3_000, 10):  # 100 tokens/s
        d.note(1, 10_000 + t, span)
    quarter, whole = d.over(13_000, span)
    assert 24 <= quarter <= 26 and 99 <= whole <= 101
    assert d.over(15_000, span) == (0, 0)  # a span and more of silence forgets it
    d.note(5, 15_100, span)
    d.note(-7, 15_200, span)  # given back: never below nothing asked
    assert d.over(15_200, span) == (0, 0)
    d.note(3, 15_300, 2_000)  # another span (the policy changed): counted afresh
    assert d.over(15_300, 2_000) == (3, 3)


def test_chunk_size_follows_demand_within_bounds():
    assert chunk_size(0, 0, 0, 1, 40) == 1  # nothing asked yet: one request's cost
    assert chunk_size(25, 6, 0, 1, 40) == 7  # a quarter of what one validity was asked, rounded up
    assert chunk_size(25, 12.5, 0, 1, 40) == 13  # a burst in the last quarter: all of it
    assert chunk_size(1_000, 250, 0, 1, 40) == 40  # never above chunkMax
    assert chunk_size(4, 1, 12, 1, 40) == 12  # at least what the waiting requests need
    assert chunk_size(4, 1, 0, 60, 40) == 60  # a request dearer than chunkMax buys its cost
    assert tokens_per_s(7, 1_000) == 7 and tokens_per_s(7, 250) == 28


def test_a_burst_after_a_quiet_spell_grows_the_chunk_at_once():
    lease = Chunk()
    for i in range(10):  # ten requests within 5 ms, after nothing
        lease.ask(1, 50_000 + i * 0.5, 250)
    assert lease.want(1, 2_000, 50_005, 250) == 10
    assert lease.want(1, 2_000, 50_005 + 250, 250) <= 3  # a validity later: a quarter of it at most


@given(rate=st.integers(1, 400), drop=st.floats(1.0, 1 / SPEND_SHARE))
def test_a_steady_chunk_is_spent_before_it_expires_even_if_demand_drops(rate: int, drop: float):
    """At a steady demand of ``rate`` tokens/s over a 1 s validity, the next chunk holds no more than
    the holder spends within that validity after demand falls by up to 1/SPEND_SHARE."""
    span = 1_000
    lease = Chunk()
    for i in range(rate * 2):  # two validities of demand, evenly spread
        lease.ask(1, 10_000 + i * 1_000 / rate, span)
    now = 10_000 + 2_000
    size = lease.want(1, 10_000, now, span)
    assert size <= max(1, rate / drop * span / 1_000 + 1)


def test_tokens_a_chunk_held_at_its_end_are_counted_abandoned():
    lease = Chunk()
    lease.grant(5, now_ms=0, validity_ms=100)
    lease.try_take(2, 10)
    assert lease.take_abandoned() == 0
    assert lease.usable(100) == 0 and lease.take_abandoned() == 3 and lease.take_abandoned() == 0
    for i in range(MAX_PARTS + 1):  # one part too many: the earliest-expiring is abandoned
        lease.grant(2, now_ms=200 + i, validity_ms=100)
    assert lease.take_abandoned() == 2


# ------------------------------------------------------------------------------- refunds
DEBITS = (("L1", 6), ("L2", 4))


def test_a_parts_rest_is_taken_out_for_its_refund_lead_ms_before_it_ends():
    chunk = Chunk()
    chunk.grant(10, now_ms=0, validity_ms=1_000, debits=DEBITS)
    part = chunk.try_take(3, 10)
    assert part is not None and part.debits == DEBITS
    assert chunk.refund_at_ms(10, lead_ms=100) == 900
    assert chunk.due_refunds(898, lead_ms=100) == []  # not yet (1 ms of timer granularity allowed)
    [(due, tokens)] = chunk.due_refunds(900, lead_ms=100)
    assert due is part and tokens == 7 and chunk.usable(900) == 0  # out first: never spent locally again
    assert chunk.due_refunds(950, lead_ms=100) == [] and chunk.refund_at_ms(950, 100) is None  # once per part
    # a reservation that comes back after the refund lands in its part, spendable until it ends, not refunded
    assert chunk.give_back(2, part.generation, 960, 1_000) and chunk.usable(960) == 2
    assert chunk.due_refunds(970, lead_ms=100) == []
    assert chunk.usable(1_000) == 0 and chunk.take_abandoned() == 2


def test_which_parts_are_refunded():
    chunk = Chunk()
    chunk.grant(5, now_ms=0, validity_ms=1_000)  # no debits (the reply named none): never refunded
    chunk.grant(5, now_ms=0, validity_ms=1_000, fallback=True, debits=DEBITS)  # a fallback allowance's
    assert chunk.refund_at_ms(0, 100) is None and chunk.due_refunds(990, 100) == []
    chunk = Chunk()
    chunk.grant(4, now_ms=0, validity_ms=60, debits=DEBITS)  # shorter than two leads: refunded half-way
    chunk.grant(4, now_ms=0, validity_ms=1_000, debits=(("L3", 4),))
    assert chunk.refund_at_ms(0, 100) == 30
    [(part, n)] = chunk.due_refunds(30, 100)
    assert (part.debits, n) == (DEBITS, 4) and chunk.usable(30) == 4
    assert chunk.refund_at_ms(30, 100) == 900
    chunk.try_take(4, 40)  # spent: nothing to refund
    assert chunk.refund_at_ms(40, 100) is None and chunk.due_refunds(950, 100) == []
    # a part that ended before its refund ran (a stalled loop) is refunded at once, not abandoned
    chunk = Chunk()
    chunk.grant(4, now_ms=0, validity_ms=100, debits=DEBITS)
    assert chunk.try_take(1, 100) is None and chunk.take_abandoned() == 0  # a request found it ended
    assert chunk.refund_at_ms(100, 10) == 100  # due now
    [(part, n)] = chunk.due_refunds(101, 10)
    assert (part.debits, n) == (DEBITS, 4) and chunk.due_refunds(102, 10) == []
    chunk.grant(4, now_ms=200, validity_ms=100)  # without debits: abandoned
    assert chunk.due_refunds(300, 10) == [] and chunk.take_abandoned() == 4


def test_a_part_pushed_out_by_a_renewal_is_refunded_at_once():
    chunk = Chunk()
    for i in range(MAX_PARTS):
        chunk.grant(2, now_ms=i, validity_ms=1_000, debits=((f"L{i}", 2),))
    chunk.grant(2, now_ms=MAX_PARTS, validity_ms=1_000, debits=(("L9", 2),))
    assert chunk.usable(10) == 2 * MAX_PARTS and chunk.take_abandoned() == 0
    assert chunk.refund_at_ms(10, 100) == 10
    [(part, n)] = chunk.due_refunds(10, 100)
    assert (part.debits, n) == ((("L0", 2),), 2)  # the earliest-expiring
