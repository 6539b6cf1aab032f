"""The region's lease book: timing from send/receipt, epochs, exhaustion, demand."""

import pytest

from kernel.bundle import Pool
from kernel.errors import StaleEpoch
from kernel.wire import LeaseGrant, WindowRef
from region_agent.leasing.book import PoolBook

POOL = Pool(id="atlas-minute", window_ms=60_000, limit=1_000, lease_ttl_ms=15_000, chunk_min=10, chunk_max=200)


def grant(lease_id="eu-lease-0001", granted=100, epoch=7, issued=50_000, ttl=10_000, starts_in=0, index=0):
    return LeaseGrant(lease_id=lease_id, pool=POOL.id, region="eu", granted=granted,
                      window=WindowRef(index=index, start_ms=index * 60_000, end_ms=(index + 1) * 60_000),
                      expires_at_ms=issued + ttl, ttl_ms=ttl, starts_in_ms=starts_in, epoch=epoch,
                      issued_at_ms=issued, remaining=500)


def test_lease_is_timed_from_send_so_delay_only_shortens_it():
    book = PoolBook(POOL)
    lease = book.accept(grant(), sent_at=1_000.0, received_at=1_800.0)  # 800 ms on the way
    assert lease is not None
    assert lease.deadline == 11_000.0  # sent + ttl, not received + ttl
    assert book.valid(10_999.0) == [lease] and book.valid(11_000.0) == []
    assert book.expired(11_000.0) == [lease]


def test_reply_arriving_after_its_lease_would_have_expired_adds_nothing():
    book = PoolBook(POOL)
    assert book.accept(grant(ttl=500), sent_at=0.0, received_at=600.0) is None
    assert book.leases == {}


def test_prefetched_lease_starts_no_earlier_than_receipt_plus_starts_in():
    book = PoolBook(POOL)
    lease = book.accept(grant(starts_in=1_500, ttl=16_500, index=1), sent_at=0.0, received_at=200.0)
    assert lease.valid_from == 1_700.0 and lease.deadline == 16_500.0
    assert book.valid(1_699.0) == [] and book.future(1_699.0) == [lease]


def test_older_epoch_is_refused_after_a_newer_one():
    book = PoolBook(POOL)
    book.accept(grant(epoch=9), sent_at=0.0, received_at=1.0)
    with pytest.raises(StaleEpoch):
        book.accept(grant(lease_id="eu-lease-0002", epoch=8), sent_at=2.0, received_at=3.0)
    assert "eu-lease-0002" not in book.leases


def test_zero_grant_marks_the_window_exhausted_until_its_end():
    book = PoolBook(POOL)
    assert book.accept(grant(granted=0, issued=59_000), sent_at=100.0, received_at=150.0) is None
    assert book.exhausted(500.0) and book.exhausted_retry_ms(500.0) == 600
    assert not book.exhausted(1_100.0)
    assert not book.needs_topup(0, 500.0, rtt_ms=10.0)


def test_demand_rate_drives_want_within_chunk_bounds_and_low_water():
    book = PoolBook(POOL)
    t = 0.0
    for _ in range(40):  # 100 tokens/s for 10 s
        book.note_demand(25, t)
        t += 250.0
    assert 60 < book.demand_rate <= 100
    assert POOL.chunk_min <= book.want(2_000) <= POOL.chunk_max
    assert book.low_water(rtt_ms=50.0) >= 1
    assert book.needs_topup(0, t, rtt_ms=50.0) and not book.needs_topup(10_000, t, rtt_ms=50.0)


def test_replay_of_our_own_request_from_an_older_epoch_is_accepted_but_a_foreign_one_is_not():
    """After a failover the new leader answers our retried lease id from etcd's record, which
    carries the epoch it was committed under; the grant was debited, so we keep it."""
    book = PoolBook(POOL)
    book.accept(grant(lease_id="eu-lease-0001", epoch=9), sent_at=0.0, received_at=1.0)
    import msgspec
    replay = msgspec.structs.replace(grant(lease_id="eu-lease-0002", epoch=8), replayed=True)
    lease = book.accept(replay, sent_at=2.0, received_at=3.0, requested_id="eu-lease-0002")
    assert lease is not None and book.max_epoch == 9
    with pytest.raises(StaleEpoch):
        book.accept(msgspec.structs.replace(grant(lease_id="eu-lease-0003", epoch=8), replayed=True),
                    sent_at=4.0, received_at=5.0, requested_id="eu-lease-0004")


def test_a_burst_asks_for_its_rate_before_the_average_catches_up():
    """At the start of a burst the EWMA is still ~0: the request asks for the rate being counted,
    not chunkMin (16 chunkMin leases filled the regional balance's entries and stopped deposits)."""
    book = PoolBook(POOL)
    for i in range(20):  # 20 tokens in the first 100 ms: 200/s, no EWMA fold yet
        book.note_demand(1, float(i * 5))
    assert book.demand_rate == 0.0
    assert book.want(2_000) == POOL.chunk_min  # what the average alone would ask for
    assert book.want(2_000, now=100.0) == POOL.chunk_max  # 200/s x 2 s, within the chunk bounds


def test_a_refused_deposit_pauses_topups_for_the_backoff():
    book = PoolBook(POOL)
    assert book.needs_topup(0, 1_000.0, rtt_ms=10.0)
    book.note_refused(1_000.0, backoff_ms=1_000.0)
    assert not book.needs_topup(0, 1_999.0, rtt_ms=10.0)
    assert book.needs_topup(0, 2_000.0, rtt_ms=10.0)


def test_no_top_up_within_two_round_trips_of_the_next_windows_lease():
    """The last lease of window 0 ends at 60,000 (allocator time; 10,000 here); the next window's
    lease is held from 10,050 (its start, late by the round trip it came in). A top-up asked for
    with a 100 ms round trip later than 9,850 would land with little or nothing of window 0 left
    to spend (or after it ended: a second lease of window 1): none is asked. Without the next lease
    held, it is (the top-up's grant leads to the next window's)."""
    book = PoolBook(POOL)
    book.accept(grant(issued=58_000, ttl=2_000), sent_at=8_000.0, received_at=8_040.0)  # window 0 to 10,000
    assert book.needs_topup(0, 9_901.0, rtt_ms=100.0)  # nothing of window 1 held yet
    book.accept(grant(lease_id="eu-lease-0002", issued=58_450, ttl=16_550, starts_in=1_550, index=1),
                sent_at=8_450.0, received_at=8_500.0)  # window 1, from 10,050 here
    assert book.needs_topup(0, 9_850.0, rtt_ms=100.0)  # lands at 9,950
    assert not book.needs_topup(0, 9_851.0, rtt_ms=100.0)
    assert not book.needs_topup(0, 9_960.0, rtt_ms=50.0)
    assert book.needs_topup(0, 9_940.0, rtt_ms=50.0)
    assert not book.needs_topup(0, 10_020.0, rtt_ms=100.0)  # window 0 over on this clock, its lease expired
