from region_agent.store.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def test_opens_after_consecutive_failures_and_refuses_until_cool_down():
    b = CircuitBreaker(failure_threshold=3, open_s=1.0, half_open_probes=2)
    for t in range(2):
        assert b.allow(t)
        b.failure(t)
    assert b.state == CLOSED
    b.failure(2.0)
    assert b.state == OPEN
    assert not b.allow(2.5)  # open: nothing is sent
    assert b.allow(3.1) and b.state == HALF_OPEN  # cool-down over: a probe goes through
    assert b.allow(3.1)
    assert not b.allow(3.1)  # only two probes while half-open


def test_half_open_probe_success_closes_and_failure_reopens():
    b = CircuitBreaker(failure_threshold=1, open_s=1.0)
    b.failure(0.0)
    assert b.allow(1.5) and b.state == HALF_OPEN
    b.success()
    assert b.state == CLOSED and b.failures == 0
    b.failure(2.0)
    assert b.state == OPEN
    assert b.allow(3.5)
    b.failure(3.5)
    assert b.state == OPEN and not b.allow(4.0)


def test_a_success_resets_the_failure_count():
    b = CircuitBreaker(failure_threshold=3)
    b.failure(0)
    b.failure(0)
    b.success()
    b.failure(0)
    b.failure(0)
    assert b.state == CLOSED


def test_a_probe_that_ends_on_the_callers_deadline_gives_its_slot_back():
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, half_open_probes=1)
    b.failure(0.0)
    assert b.allow(1.5) and not b.allow(1.5)
    b.release_probe()
    assert b.allow(1.6) and b.state == HALF_OPEN
