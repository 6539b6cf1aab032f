"""The package is self-contained: a wheel built from the project, installed (not editable) in a
fresh virtualenv, runs an agent from ``/`` with no repository on the path and no
``LEASEHOLD_LUA_DIR`` — the Lua scripts and the sample policies come from the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from leasehold.procs import Proc, free_port, wait_http_ready

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # build from a clean copy: an in-tree build would write build/ and *.egg-info into the checkout
    src = out / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", ".run", "chaos-reports", "bench-results", "__pycache__",
        ".hypothesis", ".pytest_cache", "node_modules"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out / "dist"), str(src)])
    (wheel,) = (out / "dist").glob("leasehold-*.whl")
    venv = out / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)])
    return venv


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("LEASEHOLD_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_wheel_carries_scripts_and_samples(wheel_venv: Path):
    py = str(wheel_venv / "bin" / "python")
    probe = ("import region_agent, kernel.resources as r; from region_agent.store.scripts import Scripts;"
             "s = Scripts(); print(region_agent.__file__); print(s.lua_dir); print(len(s.scripts));"
             "print(r.sample_policy('northstar-global.json').is_file())")
    lines = _run([py, "-c", probe], cwd="/", env=_clean_env()).stdout.split()
    site = str(wheel_venv)
    assert lines[0].startswith(site) and not lines[0].startswith(str(ROOT)), lines  # the installed copy
    assert lines[1].startswith(site), lines  # scripts from the package, not the repository
    assert int(lines[2]) == len(list((ROOT / "lua").glob("*.lua")))
    assert lines[3] == "True"


def test_agent_from_wheel_admits_from_root(wheel_venv: Path, redis_url: str, tmp_path: Path):
    port = free_port()
    argv = [str(wheel_venv / "bin" / "python"), "-m", "region_agent", "--redis-url", redis_url,
            "--region", "eu", "--host", "127.0.0.1", "--port", str(port), "--policy-poll-ms", "0",
            "--insecure-dev-pepper", "--auth-disabled"]  # default policy: the shipped sample
    proc = Proc("agent-wheel", argv, tmp_path / "agent", env=_clean_env(), cwd="/").start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready({base: proc}, timeout=60)
        r = httpx.post(base + "/v1/admit", timeout=5, json={
            "requestId": "wheel-0001", "tenantId": "atlas", "principal": {"type": "user", "id": "U-17"},
            "routeGroup": "read", "method": "GET", "costHint": 1})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["allowed"] is True and d["policyId"] == "read-user-v3" and d["policyVersion"] == 42
        assert d["remaining"] == 19 and d["fallback"] is False
    finally:
        proc.stop()
