from region_agent.algorithms import LocalBuckets
from region_agent.algorithms.fixed_window import WindowParams
from region_agent.algorithms.token_bucket import TokenBucketParams

P = TokenBucketParams(2_000, 1_000, 1_000, 1_000)


def test_local_bucket_limits_and_refills():
    lb = LocalBuckets(max_size=4)
    got = [lb.decide("r", "k", P, 1_000).allowed for _ in range(3)]
    assert got == [True, True, False]
    assert lb.decide("r", "k", P, 2_000).allowed


def test_local_buckets_bounded_lru():
    lb = LocalBuckets(max_size=2)
    lb.decide("r", "a", P, 0)
    lb.decide("r", "b", P, 0)
    lb.decide("r", "a", P, 0)  # touch a: b is now least recent
    lb.decide("r", "c", P, 0)
    assert len(lb) == 2 and lb.state("r", "b") is None and lb.state("r", "a") is not None


def test_local_fixed_window():
    lb = LocalBuckets()
    p = WindowParams(1, 1_000)
    assert lb.decide("r", "k", p, 10, algorithm="fw").allowed
    assert not lb.decide("r", "k", p, 20, algorithm="fw").allowed
