"""ruff runs in ``make test`` (so in CI, whose entry point is ``make test``) with the
repository's configuration (``[tool.ruff]`` in pyproject.toml); ``make lint`` runs the same check
by hand."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).with_name("ruff")
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    assert exe, "ruff is in the test extra: make setup installs it"
    r = subprocess.run([exe, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
