from region_agent.decision.negcache import EXACT_MAX_MS, PROBE_MS, NegativeCache


def test_denies_for_min_of_hint_and_cap_then_forgets():
    c = NegativeCache(cap_ms=250)
    c.put(("k", (1,)), 1_000.0, 500, "payload")
    hit = c.get(("k", (1,)), 1_100.0)
    assert hit is not None and hit.payload == "payload" and hit.retry_at_ms == 1_500.0
    assert c.get(("k", (1,)), 1_250.0) is None  # capped at 250 ms although the hint was 500: this caller probes
    assert c.get(("k", (1,)), 1_260.0).payload == "payload"  # the others keep the denial while it does
    c.forget(("k", (1,)))  # the probe was admitted
    assert c.get(("k", (1,)), 1_270.0) is None and len(c) == 0
    c.put(("k", (1,)), 0.0, 40, "short")
    assert c.get(("k", (1,)), 39.0) is not None and c.get(("k", (1,)), 40.0) is None
    assert c.get(("k", (1,)), 40.0 + PROBE_MS) is None  # a probe that never answered: the next caller probes


def test_never_and_zero_hints_are_not_cached_and_cost_is_part_of_the_key():
    c = NegativeCache()
    c.put(("k", (10,)), 0.0, -1, "never")
    c.put(("k", (10,)), 0.0, 0, "zero")
    assert c.get(("k", (10,)), 1.0) is None
    c.put(("k", (10,)), 0.0, 3_500, "export")
    assert c.get(("k", (1,)), 1.0) is None  # a cheaper request on the same key still asks the store


def test_bounded_evicts_oldest():
    c = NegativeCache(max_entries=3)
    for i in range(5):
        c.put((f"k{i}",), 0.0, 100, i)
    assert len(c) == 3
    assert c.get(("k0",), 1.0) is None and c.get(("k4",), 1.0).payload == 4


def test_an_exact_hint_is_held_whole_and_an_inexact_one_capped():
    c = NegativeCache(cap_ms=250)
    c.put(("bucket", (1,)), 1_000.0, 3_500, "bucket", exact=True)
    c.put(("pool", (1,)), 1_000.0, 3_500, "pool")
    assert c.get(("bucket", (1,)), 4_499.0).payload == "bucket"  # nothing but time refills a bucket
    assert c.get(("bucket", (1,)), 4_500.0) is None
    assert c.get(("pool", (1,)), 1_250.0) is None  # a top-up may come sooner than the hint
    c.put(("window", (1,)), 0.0, 10 * EXACT_MAX_MS, "long", exact=True)
    assert c.get(("window", (1,)), EXACT_MAX_MS - 1.0) is not None
    assert c.get(("window", (1,)), float(EXACT_MAX_MS)) is None  # asked again after EXACT_MAX_MS
    off = NegativeCache(cap_ms=0)
    off.put(("bucket", (1,)), 0.0, 3_500, "off", exact=True)
    assert off.get(("bucket", (1,)), 1.0) is None  # cap 0 disables the cache


def test_store_calls_per_attempt_follow_the_hint_not_the_attempt_rate():
    """Figure 5's ratio in the pure model: a hot key denied with a 1 s hint, attempted at two
    rates; the store is asked once per hint either way (before: once per 250 ms)."""
    for attempts_per_s in (2_000, 200):
        c, calls, step = NegativeCache(cap_ms=250), 0, 1_000 / attempts_per_s
        t = 0.0
        while t < 10_000:
            if c.get(("hot", (1,)), t) is None:
                calls += 1
                c.put(("hot", (1,)), t, 1_000 - int(t) % 1_000 or 1_000, "denied", exact=True)
            t += step
        assert calls <= 11, (attempts_per_s, calls)


def test_one_probe_per_expiry_however_many_attempts_are_in_flight():
    """64 attempts arrive in the same millisecond just after the hold ends: one reaches the store."""
    c = NegativeCache(cap_ms=250)
    c.put(("hot", (1,)), 0.0, 500, "denied", exact=True)
    misses = sum(c.get(("hot", (1,)), 500.0) is None for _ in range(64))
    assert misses == 1
    c.put(("hot", (1,)), 501.0, 500, "denied again", exact=True)  # the probe was denied again
    assert c.get(("hot", (1,)), 600.0).payload == "denied again"
