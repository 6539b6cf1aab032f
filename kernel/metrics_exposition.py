"""How a service's ``/metrics`` is rendered: its own registry plus the standard process,
platform and garbage-collector collectors, and ``leasehold_build_info``; with several worker
processes (``--workers N``), prometheus_client's multiprocess mode.

Several workers: uvicorn's workers share one listening socket, so a scrape reaches one of them
at random. Every worker writes its counters, histograms and gauges to memory-mapped files in
``PROMETHEUS_MULTIPROC_DIR`` (set by the agent's ``__main__`` before the workers start), and the
worker that answers a scrape renders them all summed (:class:`prometheus_client.multiprocess.
MultiProcessCollector`; gauges by the mode each declares: ``livemax``, ``livemin``). Collectors
that read the same thing in every worker (the store's INFO, the policy age, the build) are
rendered from the answering worker; the process metrics are the workers' summed
(:class:`WorkerProcesses`). docs/decisions/ says why this mode and not per-worker labels.

A worker that ends without its exit code (killed, e.g. by the OOM killer; uvicorn starts another)
leaves its live-mode gauge files behind: :func:`forget_dead_workers`, run before every rendering,
drops the files of pids no longer running, so a dead worker's last breaker state or stream count
does not stay in the gauges for ever. Its counters and histograms stay (a count never goes down).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_SUMMED = ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_cpu_seconds_total",
           "process_open_fds")

__all__ = ["MULTIPROC_ENV", "Collectors", "FunctionGauge", "WorkerProcesses", "forget_dead_workers",
           "multiprocess_dir", "standard_collectors", "worker_metrics_dir"]


def multiprocess_dir() -> str | None:
    """The multiprocess directory when this process is one of several workers, else None."""
    return os.environ.get(MULTIPROC_ENV) or None


@contextlib.contextmanager
def worker_metrics_dir(workers: int) -> Iterator[str | None]:
    """Around serving ``workers`` processes: with more than one, a fresh multiprocess directory in
    ``PROMETHEUS_MULTIPROC_DIR`` (inherited by the workers, removed afterwards), unless the
    environment names one already (then it is used as is: it must be empty at start)."""
    if workers <= 1 or os.environ.get(MULTIPROC_ENV):
        yield os.environ.get(MULTIPROC_ENV) if workers > 1 else None
        return
    path = tempfile.mkdtemp(prefix="leasehold-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


def forget_dead_workers(path: str, proc: str = "/proc") -> list[int]:
    """Drop the live-mode gauge files of the workers in ``path`` no longer running (module doc);
    returns their pids."""
    from prometheus_client import multiprocess

    dead = set()
    for f in Path(path).glob("gauge_live*_*.db"):
        tail = f.stem.rsplit("_", 1)[-1]
        if tail.isdigit() and not os.path.exists(os.path.join(proc, tail)):
            dead.add(int(tail))
    for pid in sorted(dead):
        with contextlib.suppress(FileNotFoundError):  # another worker's scrape removed them first
            multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]  # (unannotated in prometheus_client)
    return sorted(dead)


def standard_collectors(registry: CollectorRegistry) -> None:
    """The process (memory, CPU, open file descriptors), platform and GC collectors that the
    default registry has and a service's own registry does not."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)



def _constant(value: int) -> Callable[[], int]:
    """A function returning ``value`` (ProcessCollector asks for the pid through one)."""
    return lambda: value

class FunctionGauge:
    """A gauge whose value a function gives at collection (``set_function``), as a collector of
    its own: in multiprocess mode a ``Gauge.set_function`` would be read from no file."""

    LABELS = ()

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry | None = None):
        self.name, self.documentation = name, documentation
        self._fn: Callable[[], float] = lambda: 0.0
        if registry is not None:
            registry.register(self)

    def set_function(self, fn: Callable[[], float]) -> None:
        self._fn = fn

    def set(self, value: float) -> None:
        self._fn = lambda: value

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, value=float(self._fn()))


class WorkerProcesses:
    """The process metrics of every live worker summed (memory, CPU seconds, open file
    descriptors; the oldest start time, the largest fd limit): the agent as one process. The
    workers are the pids whose files are in the multiprocess directory."""

    LABELS = ()

    def __init__(self, path: str, proc: str = "/proc"):
        self.path, self.proc = Path(path), proc

    def pids(self) -> list[int]:
        out = set()
        for f in self.path.glob("*.db"):
            tail = f.stem.rsplit("_", 1)[-1]
            if tail.isdigit() and os.path.exists(os.path.join(self.proc, tail)):
                out.add(int(tail))
        return sorted(out) or [os.getpid()]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for pid in self.pids():
            for fam in ProcessCollector(pid=_constant(pid), proc=self.proc, registry=None).collect():
                have = families.get(fam.name)
                if have is None:
                    families[fam.name] = fam
                    continue
                value = fam.samples[0].value
                old = have.samples[0]
                if have.name + ("_total" if have.type == "counter" else "") in _SUMMED or have.name in _SUMMED:
                    new = old.value + value
                elif have.name.endswith("start_time_seconds"):
                    new = min(old.value, value)
                else:
                    new = max(old.value, value)
                have.samples[0] = old._replace(value=new)
        return list(families.values())


class Collectors:
    """Several collectors rendered as one registry (``generate_latest`` accepts it)."""

    def __init__(self, collectors: list[Any]):
        self.collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for c in self.collectors:
            yield from c.collect()
