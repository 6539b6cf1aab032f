"""``leasehold_build_info{version, commit}``: which build a process runs (value 1), exported by
both services. Version and commit are :mod:`kernel.version`'s, the ones ``--version`` prints."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from .version import COMMIT_ENV, __version__, build_commit


def build_info() -> tuple[str, str]:
    """``(version, commit)`` of this build (the commit is read once per process)."""
    return __version__, build_commit()


class BuildInfo:
    """The ``leasehold_build_info`` collector (one series, value 1)."""

    NAME = "leasehold_build_info"
    HELP = "The build this process runs: package version and source commit (value 1)"
    LABELS = ("version", "commit")

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)]

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        fam.add_metric(list(build_info()), 1)
        yield fam


__all__ = ["COMMIT_ENV", "BuildInfo", "build_info"]
