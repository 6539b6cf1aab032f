"""``python -m bench`` stopped by SIGTERM (a CI job's timeout, ``kill``) stops every server it
started: each figure stops its servers by PID on the way out, and SIGTERM unwinds like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def processes_naming(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process that runs in ``text`` (the run's directory) or names it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, or not ours
            continue
        if text in cmd or cwd.startswith(text):
            found.append((int(entry.name), cmd))
    return found


def test_sigterm_stops_every_server_the_bench_started(tmp_path: Path):
    out = tmp_path / "bench-out"
    bench = subprocess.Popen([sys.executable, "-m", "bench", "--quick", "--only", "1", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        servers: list[tuple[int, str]] = []
        while time.monotonic() < deadline and bench.poll() is None:  # the figure's Redis and agent up
            servers = [p for p in processes_naming(str(out)) if p[0] != bench.pid]
            if any("region_agent" in cmd for _, cmd in servers):
                break
            time.sleep(0.2)
        assert bench.poll() is None and any("region_agent" in cmd for _, cmd in servers), servers
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and processes_naming(str(out)):
            time.sleep(0.2)
        left = processes_naming(str(out))
        assert not left, f"still running after the bench's exit: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid, _ in processes_naming(str(out)):
            os.kill(pid, signal.SIGKILL)
