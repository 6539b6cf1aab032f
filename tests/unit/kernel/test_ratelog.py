"""kernel.ratelog: log lines that can repeat at request rate stay a few per interval."""

from __future__ import annotations

import logging

from kernel.ratelog import KeyedLog, ThrottleFilter, TransitionLog
from tests.support.clock import FakeClock


def test_keyed_log_writes_one_line_per_key_per_interval_and_counts_the_rest(caplog):
    clock = FakeClock(100.0)
    log = KeyedLog(logging.getLogger("t.keyed"), interval_s=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.keyed"):
        assert log.log("a", logging.WARNING, "refused")
        assert not log.log("a", logging.WARNING, "refused")
        assert not log.log("a", logging.WARNING, "refused")
        assert log.log("b", logging.WARNING, "other key")  # its own throttle
        clock.t += 1.0
        assert log.log("a", logging.WARNING, "refused")
    assert [r.getMessage() for r in caplog.records] == ["refused", "other key",
                                                        "refused (+2 more since the last line)"]


def test_keyed_log_state_is_bounded():
    log = KeyedLog(logging.getLogger("t.bounded"), max_keys=10, clock=FakeClock(100.0))
    for i in range(100):
        log.log(i, logging.DEBUG, "x")
    assert len(log._last) <= 10


def test_transition_log_writes_changes_at_most_once_per_interval_and_ends_on_the_current_state(caplog):
    clock = FakeClock(100.0)
    t = TransitionLog(logging.getLogger("t.trans"), initial=True, interval_s=10.0, clock=clock)

    def line(state, changes):
        return logging.WARNING, f"{'up' if state else 'down'} after {changes} changes"

    with caplog.at_level(logging.INFO, logger="t.trans"):
        assert not t.observe(True, line)  # no change from the start
        assert t.observe(False, line)  # down: written at once
        clock.t += 1
        assert not t.observe(True, line)  # flapping inside the interval: counted
        assert not t.observe(False, line)
        assert not t.observe(True, line)
        clock.t += 10
        assert t.observe(True, line)  # the interval passed: the current state, with the changes
        assert not t.observe(True, line)
    assert [r.getMessage() for r in caplog.records] == ["down after 1 changes", "up after 3 changes"]


def test_transition_log_is_silent_when_the_state_came_back_to_what_was_logged(caplog):
    clock = FakeClock(100.0)
    t = TransitionLog(logging.getLogger("t.back"), initial="ok", interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.back"):
        t.observe("ok", lambda s, c: (logging.INFO, s))
        clock.t += 20
        assert not t.observe("ok", lambda s, c: (logging.INFO, s))
    assert caplog.records == []


def test_throttle_filter_passes_one_record_per_template_per_interval_cut_short_with_the_count(caplog):
    clock = FakeClock(100.0)
    logger = logging.getLogger("t.library")
    throttle = ThrottleFilter(interval_s=10.0, max_chars=20, clock=clock)
    logger.addFilter(throttle)
    try:
        with caplog.at_level(logging.WARNING, logger="t.library"):
            for i in range(5):
                logger.warning("bad member %s", f"m{i}" * 30)
            logger.warning("another kind")
            clock.t += 10.0
            logger.warning("bad member %s", "last")
    finally:
        logger.removeFilter(throttle)
    assert [r.getMessage() for r in caplog.records] == [
        "bad member m0m0m0m0m...", "another kind", "bad member last (+4 more since the last line)"]


async def test_the_last_lines_held_back_are_written_with_their_count_when_none_follows(caplog):
    """A flood that stops: once the interval is over, the last line held back is written with the
    count of the others (a timer on the running loop), for the keyed log and the filter alike."""
    import asyncio

    keyed = KeyedLog(logging.getLogger("t.flood"), interval_s=0.05)
    library = logging.getLogger("t.flood.library")
    throttle = ThrottleFilter(interval_s=0.05)
    library.addFilter(throttle)
    try:
        with caplog.at_level(logging.INFO):
            for i in range(5):
                keyed.log("k", logging.INFO, f"refused {i}")
                library.warning("bad member %s", i)
            await asyncio.sleep(0.2)
    finally:
        library.removeFilter(throttle)
    assert [r.getMessage() for r in caplog.records if r.name == "t.flood"] == [
        "refused 0", "refused 4 (+3 more since the last line)"]
    assert [r.getMessage() for r in caplog.records if r.name == "t.flood.library"] == [
        "bad member 0", "bad member 4 (+3 more since the last line)"]
