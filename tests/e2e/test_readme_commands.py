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


def doc_block(page: str, word: str) -> str:
    (found,) = [b for b in re.findall(r"^```sh\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M) if word in b]
    return found


def test_the_docs_commands_against_a_real_topology(tmp_path: Path):
    """What a new user runs after the README, as written: docs/api.md's variables, docs/cli.md's
    `curl` through `status -o json`, docs/policy.md's quick start (in a copy of policies/) and its
    canary release (a block that once staged three slices in a row, the second refused as a
    narrowing, and ended with a rollback after the promote; and `up` published nothing, so its
    first line was refused: "nothing is published yet"); and the obvious mistakes: `up` twice,
    `down` twice, `status` with nothing up — one line each, the documented exit codes."""
    run_dir = tmp_path / "run"
    shutil.copytree(ROOT / "policies", tmp_path / "policies")
    (tmp_path / "new.yaml").write_text((ROOT / "policies" / "northstar-global.yaml").read_text()
                                       .replace("version: 42", "version: 43", 1))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEASEHOLD_")},
           "LEASEHOLD_RUN_DIR": str(run_dir), "PATH": f"{BIN}:{os.environ['PATH']}", "EDITOR": "true",
           "PYTHONPATH": str(ROOT)}

    def sh(script: str) -> subprocess.CompletedProcess:
        # `[--key K]`: an optional part the page shows, left out
        return run(re.sub(r"\s*\[--[^\]\n]*\]", "", script.replace(".venv/bin/", f"{BIN}/")), tmp_path, env)

    try:
        up = sh(".venv/bin/leasehold up")
        assert up.returncode == 0, up.stderr
        again = sh(".venv/bin/leasehold up")
        assert again.returncode == 2 and again.stderr == ("leasehold: a topology is already running; "
                                                          "`leasehold down` first\n"), again.stderr
        r = sh(doc_block("docs/api.md", "STATUS=") + 'echo "$AGENT $ALLOC"\n')
        assert r.returncode == 0 and re.fullmatch(r"http://127\.0\.0\.1:\d+ http://127\.0\.0\.1:\d+\n", r.stdout), r
        r = sh(doc_block("docs/cli.md", "urls.agents.eu"))
        assert r.returncode == 0, r.stderr
        decision = json.loads(r.stdout)
        assert decision["allowed"] is True and decision["decisionId"] == "req-00000001", decision
        r = sh(doc_block("docs/policy.md", "policy bump"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "version 42 -> 43" in r.stdout and "rules that apply" in r.stdout and "compiled bundle 43" in r.stdout
        assert json.loads((tmp_path / "policies" / "northstar.json").read_text())["bundleVersion"] == 43
        r = sh(doc_block("docs/policy.md", "policy canary"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "staged bundle 43 for regions eu" in r.stdout and "tenants atlas" in r.stdout
        assert "promoted: bundle 43 is published to every agent" in r.stdout
        # the start bundle, published by `up`, was no refusal for the services that follow etcd
        urls = json.loads(sh(".venv/bin/leasehold status -o json").stdout)["urls"]
        for url, name in ((urls["agents"]["eu"][0], "agent"), (urls["allocators"][0], "allocator")):
            metrics = subprocess.run(["curl", "-s", url + "/metrics"], capture_output=True, text=True).stdout
            assert f'leasehold_{name}_policy_reloads_total{{outcome="stale"}} 0.0' in metrics, name
    finally:
        down = sh(".venv/bin/leasehold down")
    assert down.returncode == 0 and down.stdout.startswith("stopped: "), down
    down = sh(".venv/bin/leasehold down")
    assert down.returncode == 0 and down.stdout == "stopped: nothing was running\n" and not down.stderr, down
    status = sh(".venv/bin/leasehold status")
    assert status.returncode == 6 and status.stderr.startswith("leasehold: no local topology is running"), status
    assert len(status.stderr.splitlines()) == 1 and not status.stdout
