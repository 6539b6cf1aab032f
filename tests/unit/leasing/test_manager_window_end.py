"""Anything bought from a pool balance (a gateway chunk) ends with the window of the lease it
was bought from: tokens of window k are never spent in window k+1."""

from kernel.bundle import Pool
from region_agent.leasing.book import PoolBook
from region_agent.leasing.client import AllocatorClient
from region_agent.leasing.manager import Balance, LeaseManager

from .test_book import grant

POOL = Pool(id="global-read", window_ms=1_000, limit=40_000, lease_ttl_ms=1_000, chunk_min=100, chunk_max=2_000)


def test_window_end_of_the_earliest_valid_lease():
    now = [10_010.0]
    mgr = LeaseManager(region="eu", client=AllocatorClient(["http://127.0.0.1:9"]), store=None,  # type: ignore[arg-type]
                       now=lambda: now[0])
    book = PoolBook(POOL)
    # issued 800 ms into a 1 s window: 200 ms of the window left when it was sent at t=10,000
    book.accept(grant(lease_id="eu-lease-0001", issued=800, ttl=200, index=0), sent_at=10_000.0, received_at=10_005.0)
    mgr.balances["k"] = Balance(pool=POOL, key="k", book=book)
    assert mgr.window_end("k") == 10_000.0 + (60_000 - 800)  # grant() builds 60 s windows; end - issued
    assert mgr.window_end("missing") is None
    now[0] = 10_000.0 + 300  # the lease is gone: nothing to bound by
    assert mgr.window_end("k") is None
