"""kernel.httpserver.freeze_startup_heap: what is alive at the end of start-up leaves the cyclic
collector's walk (full collections held an agent's event loop for 45-68 ms before), and the young
generation's threshold is raised to YOUNG_THRESHOLD (decision 0085)."""

import gc

from kernel.httpserver import YOUNG_THRESHOLD, freeze_startup_heap


def test_the_objects_alive_at_startup_are_frozen() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]
    before = gc.get_threshold()
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > len(kept)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert gc.get_freeze_count() == 0


def test_the_young_generation_threshold_is_raised_and_the_older_ones_kept() -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults, whatever the test process had
    try:
        freeze_startup_heap()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        gc.set_threshold(700, 7, 9)
        freeze_startup_heap()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 7, 9)  # the older generations' as they were
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert 700 < YOUNG_THRESHOLD <= 20_000  # the measured range (bench/README.md, decision 0085)
