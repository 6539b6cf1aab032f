"""Pure parts of the overload handling (docs/concepts.md: overload is shed): the event-loop lag monitor and the
cost-aware local denial of a chunk."""

from region_agent.leasing.chunks import Chunk
from region_agent.store.lag import LoopLag


def test_loop_lag_is_the_worst_recent_lateness_and_an_overdue_tick():
    clock = [0.0]
    lag = LoopLag(interval_s=0.01, window_s=0.5, clock=lambda: clock[0])
    lag.running = True
    lag.tick(0.01)  # on time
    assert lag.lag_s(0.012) < 1e-9
    lag.tick(0.09)  # due at 0.02: 70 ms late
    assert abs(lag.lag_s(0.095) - 0.07) < 1e-9
    assert abs(lag.lag_s(0.3) - 0.2) < 1e-9  # the next tick (due 0.10) is 200 ms overdue right now
    lag.tick(0.7)
    lag.tick(0.71)
    assert abs(lag.lag_s(1.2) - 0.6) < 1e-9  # the 600 ms late tick at 0.7 is still within the window
    lag.tick(1.25)
    assert lag.lag_s(1.25) < 0.6  # ... and then it is not


def test_a_chunk_denial_blocks_only_requests_at_least_as_expensive():
    lease = Chunk()
    lease.grant(50, 0.0, 250)
    assert lease.try_take(10, 1.0) is not None
    lease.deny(2.0, 100, 250, min_cost=1_000)  # a 1,000-token request could not be paid
    assert lease.negative(3.0, 1_000) and lease.negative(3.0, 5_000)
    assert not lease.negative(3.0, 1)  # cheap requests are not blocked ...
    assert lease.try_take(1, 3.0) is not None and lease.usable(3.0) == 39  # ... and the chunk still pays them
    assert not lease.negative(200.0, 1_000)
