from region_agent.negcache import NegativeCache


def test_denies_for_min_of_hint_and_cap_then_forgets():
    c = NegativeCache(cap_ms=250)
    c.put(("k", (1,)), 1_000.0, 500, "payload")
    hit = c.get(("k", (1,)), 1_100.0)
    assert hit is not None and hit.payload == "payload" and hit.retry_at_ms == 1_500.0
    assert c.get(("k", (1,)), 1_250.0) is None  # capped at 250 ms although the hint was 500
    assert len(c) == 0
    c.put(("k", (1,)), 0.0, 40, "short")
    assert c.get(("k", (1,)), 39.0) is not None and c.get(("k", (1,)), 40.0) is None


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
