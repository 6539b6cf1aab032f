"""``leasehold_build_info{version, commit}``: which build a process runs (value 1), exported by
both services. The version is the installed package's; the commit comes from
``LEASEHOLD_BUILD_COMMIT`` (set by an image build), else from the source checkout's git HEAD,
else ``unknown``."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily

COMMIT_ENV = "LEASEHOLD_BUILD_COMMIT"
_ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=1)
def build_info() -> tuple[str, str]:
    """``(version, commit)`` of this build (read once per process)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("leasehold")
    except PackageNotFoundError:
        ver = "unknown"
    commit = os.environ.get(COMMIT_ENV, "").strip()
    if not commit and (_ROOT / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short=12", "HEAD"],
                                 capture_output=True, text=True, timeout=2)
            commit = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return ver, commit[:40] or "unknown"


class BuildInfo:
    """The ``leasehold_build_info`` collector (one series, value 1)."""

    NAME = "leasehold_build_info"
    HELP = "The build this process runs: package version and source commit (value 1)"
    LABELS = ("version", "commit")

    def describe(self) -> list:
        return [GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)]

    def collect(self):
        fam = GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        fam.add_metric(list(build_info()), 1)
        yield fam


__all__ = ["COMMIT_ENV", "BuildInfo", "build_info"]
