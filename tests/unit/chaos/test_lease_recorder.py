"""The agent-side lease recorder writes history records on the wall clock."""

from __future__ import annotations

from pathlib import Path

from chaos.history import Grant, HistoryWriter, LeaseRecorder, SpendClose, read_history
from kernel.wire import LeaseGrant, WindowRef


def test_recorder_converts_monotonic_times_and_writes_grants_and_closes(tmp_path: Path):
    path = tmp_path / "agent.jsonl"
    grant = LeaseGrant(lease_id="eu-0123456789", pool="p-global", region="eu", granted=10,
                       window=WindowRef(index=5, start_ms=50_000, end_ms=60_000), expires_at_ms=55_000, ttl_ms=5_000,
                       starts_in_ms=0, epoch=7, issued_at_ms=50_000, remaining=90)
    with HistoryWriter(path) as w:
        rec = LeaseRecorder(w, mono_ms=1_000.0, wall_ms=1_800_000_000_000)
        rec.grant(region="eu", pool="p-global", key_tag="{g:p-global}", lease=None, grant=grant,
                  sent_at=1_500.0, received_at=1_520.5)
        rec.grant(region="eu", pool="p-global", key_tag="{g:p-global}", lease=None, grant=object(),
                  sent_at=0.0, received_at=0.0)  # not a grant: ignored
        rec.closed(region="eu", pool="p-global", lease_id="eu-0123456789", granted=10, spent=7)
    g, c = list(read_history(path))
    assert isinstance(g, Grant) and isinstance(c, SpendClose)
    assert (g.sent_at_ms, g.received_at_ms) == (1_800_000_000_500, 1_800_000_000_520)
    assert (g.window_index, g.window_end_ms, g.epoch, g.accepted) == (5, 60_000, 7, True)
    assert (c.lease_id, c.granted, c.spent) == ("eu-0123456789", 10, 7)
