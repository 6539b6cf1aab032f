"""The README's commands work as written: its shell blocks are run through bash (``set -euo
pipefail``) against a real local topology and a copy of deploy/. Only two things are substituted:
``.venv/bin/`` is this test's own virtualenv, and the run directory is a temporary one
(``LEASEHOLD_RUN_DIR``), so a developer's running topology is never touched. The ``make`` lines are
checked by tests/unit/test_docs.py (they would install and run the whole suite)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def blocks() -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def block_with(word: str) -> str:
    (found,) = [b for b in blocks() if word in b]
    return found


def run(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_call_it_against_a_real_topology(tmp_path: Path):
    script = block_with("leasehold up")
    assert script.rstrip().endswith(".venv/bin/leasehold down")
    run_dir = tmp_path / "run"
    script = script.replace(".venv/bin/", f"{BIN}/")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")},
           "LEASEHOLD_RUN_DIR": str(run_dir), "PATH": f"{BIN}:{os.environ['PATH']}"}
    try:
        r = run(script, ROOT, env)
    finally:  # whatever happened, nothing keeps running
        subprocess.run([f"{BIN}/leasehold", "--run-dir", str(run_dir), "down"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"^agent\s+agent-eu-1\s+pid \d+\s+ready\s+http://127\.0\.0\.1:\d+$", out, re.M), out
    assert "all services ready" in out
    decision = json.loads(re.search(r'^\{"allowed".*\}$', out, re.M).group(0))
    assert decision["allowed"] is True and decision["policyId"] == "read-user-v3", decision
    assert decision["decisionId"] == "r-9f3a61c2e07b4d18" and decision["remaining"] == 19
    pool = json.loads(re.search(r'^\{"pool".*\}$', out, re.M).group(0))
    assert pool["pool"] == "atlas-minute" and pool["limit"] == 1000
    assert re.search(r"^allowed: HTTP 200, rule read-user-v3", out, re.M)  # leasehold admit's answer
    assert re.search(r"^stopped: .*agent-eu-1", out, re.M)
    assert not (run_dir / "topology.json").exists()


def test_deploy_it_in_a_copy_of_the_repository(tmp_path: Path):
    script = block_with("kubectl kustomize")
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("secrets"))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}  # the test extras' kubectl first
    r = run(script.replace(".venv/bin/", f"{BIN}/"), tmp_path, env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "deploy" / "k8s-dev" / "secrets" / "pepper").is_file()
    assert "kind: Deployment" in r.stdout and "name: agent-eu" in r.stdout
