"""kernel.metrics_exposition: a dead worker's live-mode gauges are forgotten, its counts kept."""

from __future__ import annotations

from pathlib import Path

from kernel.metrics_exposition import forget_dead_workers


def test_a_dead_workers_live_gauge_files_go_and_its_counts_stay(tmp_path: Path):
    files, proc = tmp_path / "metrics", tmp_path / "proc"
    files.mkdir()
    (proc / "101").mkdir(parents=True)  # 101 runs, 202 does not
    names = ["counter_101.db", "counter_202.db", "histogram_202.db", "gauge_livemax_101.db", "gauge_livemax_202.db",
             "gauge_livesum_202.db", "gauge_livemin_202.db", "gauge_max_202.db"]
    for name in names:
        (files / name).write_bytes(b"")
    assert forget_dead_workers(str(files), proc=str(proc)) == [202]
    assert sorted(p.name for p in files.iterdir()) == sorted(
        ["counter_101.db", "counter_202.db", "histogram_202.db", "gauge_livemax_101.db", "gauge_max_202.db"])
    assert forget_dead_workers(str(files), proc=str(proc)) == []
