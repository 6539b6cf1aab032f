"""The connection cap's lines: one when a process starts refusing connections and one when it is
below the cap again with the count refused meanwhile, never one per connection (the refusals
themselves are tested against real processes: tests/integration/security/test_connection_caps.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kernel.httpserver import ConnectionCap


def test_one_line_when_refusing_starts_and_one_when_it_ends(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="kernel.httpserver")
    cap = ConnectionCap(limit=4, interval_s=0.0)
    assert not cap.at_limit(4)  # the 4th connection is within the cap
    assert all(cap.at_limit(5) for _ in range(50))  # every one past it is refused

    async def release() -> None:
        cap.released(lambda: 4)  # still at the cap: nothing to say
        cap.released(lambda: 3)

    asyncio.run(release())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0][0] == "WARNING" and "at the cap of 4" in lines[0][1]
    assert lines[1][0] == "INFO" and "50 refused meanwhile" in lines[1][1]
    assert cap.refused == 50 and not cap.refusing


def test_a_line_not_due_yet_is_written_when_it_is(caplog: pytest.LogCaptureFixture):
    """Refusing started and ended within the interval: the ending line follows once it is due,
    although no connection closes afterwards."""
    caplog.set_level(logging.INFO, logger="kernel.httpserver")
    cap = ConnectionCap(limit=1, interval_s=0.2)

    async def run() -> None:
        assert cap.at_limit(2)
        cap.released(lambda: 0)
        await asyncio.sleep(0.5)

    asyncio.run(run())
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
