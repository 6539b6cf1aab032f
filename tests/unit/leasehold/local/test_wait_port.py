"""A process that exits before listening is reported with its exit code and the end of its log
(stdout and stderr), so a failed start in a topology or a test explains itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leasehold.local.procs import Proc, free_port, wait_port


def test_an_early_exit_reports_the_tail_of_the_log(tmp_path: Path):
    proc = Proc("early", [sys.executable, "-c", "import sys; print('starting'); sys.exit('cannot start: the reason')"],
                tmp_path).start()
    try:
        with pytest.raises(RuntimeError) as e:
            wait_port(free_port(), proc=proc, timeout=30)
    finally:
        proc.stop()
    message = str(e.value)
    assert "exited with 1 before listening" in message
    assert message.rstrip().endswith("starting\ncannot start: the reason")  # stdout and stderr, in order


def test_a_bare_popen_still_gives_the_exit_code(tmp_path: Path):
    proc = Proc("early", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path).start()
    try:
        with pytest.raises(RuntimeError, match="exited with 3 before listening"):
            wait_port(free_port(), proc=proc.popen, timeout=30)
    finally:
        proc.stop()
