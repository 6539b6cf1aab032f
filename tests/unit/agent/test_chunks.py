"""A fleet-wide pool's in-process chunk lease (region_agent/leasing/chunks.py)."""

from region_agent.leasing.chunks import ChunkLease


def test_chunk_lease_spend_give_back_expiry():
    lease = ChunkLease()
    assert lease.try_take(1, 0) is None
    lease.grant(100, now_ms=0, validity_ms=250)
    gen = lease.try_take(1, 10)
    assert gen is not None and lease.remaining == 99
    assert lease.give_back(1, gen, 20) and lease.remaining == 100
    assert lease.try_take(1, 250) is None  # expired: unspent tokens abandoned
    lease.grant(10, now_ms=300, validity_ms=250)
    assert not lease.give_back(1, gen, 310)  # a reservation from an older chunk does not land here
    assert lease.deny(400, 1_000, 250) == 250 and lease.negative(500) and not lease.negative(650)
