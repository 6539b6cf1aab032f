"""The run's settings: trial count, durations and sizes for a full or ``--quick`` run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Ctx:
    out: Path
    work: Path  # process directories (logs) for this run
    quick: bool = False
    trials: int = 3
    duration_s: float = 3.0  # one trial of a throughput loop
    warmup_s: float = 0.5
    principals: int = 10_000
    batch_size: int = 100
    sweep: tuple[int, ...] = (1, 8, 32, 64, 128)  # figure 2 concurrency sweep (64 is the figure)
    scale_keys: tuple[int, ...] = (1_000, 10_000, 100_000)
    scale_pools: tuple[int, ...] = (100, 10_000)
    util_windows: int = 10
    util_window_ms: int = 2_000
    workers: int = 1  # uvicorn workers of the agent and the echo app (figure 2)
    agent_args: list[str] = field(default_factory=list)  # extra agent flags (figures 1, 2, 5), for experiments
    notes: list[str] = field(default_factory=list)
    plot_data: dict = field(default_factory=dict)

    @classmethod
    def make(cls, out: Path, quick: bool) -> Ctx:
        work = out / "run"
        if quick:
            return cls(out=out, work=work, quick=True, trials=1, duration_s=1.0, warmup_s=0.3, sweep=(8, 64),
                       scale_keys=(1_000, 10_000), scale_pools=(100, 1_000), util_windows=4)
        return cls(out=out, work=work)

    def note(self, text: str) -> None:
        self.notes.append(text)
