"""kernel.httpserver.freeze_startup_heap: what is alive at the end of start-up leaves the cyclic
collector's walk (full collections held an agent's event loop for 45-68 ms before)."""

import gc

from kernel.httpserver import freeze_startup_heap


def test_the_objects_alive_at_startup_are_frozen() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > len(kept)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0

