"""The venv's interpreter: the distribution's python3 when the machine has one, not whichever
python3 comes first on PATH; ``PYTHON=...`` picks another (docs/decisions/0088-the-venv-is-made-from-the-distributions-optimised-python.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

def _venv_commands(tmp_path: Path, *overrides: str) -> str:
    venv = tmp_path / "v"
    out = subprocess.run(["make", "-n", f"VENV={venv}", *overrides, "venv-test"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return next(line for line in out.splitlines() if "-m venv" in line)


def test_the_venv_is_made_from_the_distributions_python3(tmp_path: Path):
    expected = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else "python3"
    assert _venv_commands(tmp_path) == f"test -x {tmp_path / 'v'}/bin/python || {expected} -m venv {tmp_path / 'v'}"


def test_PYTHON_picks_another_interpreter(tmp_path: Path):
    assert f"|| /opt/cpython/bin/python3 -m venv {tmp_path / 'v'}" in _venv_commands(tmp_path, "PYTHON=/opt/cpython/bin/python3")
