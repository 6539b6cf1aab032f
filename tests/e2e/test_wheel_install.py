"""The runtime wheel is self-contained and carries only the product: built from the project,
installed (not editable, at the versions of constraints.txt) in a fresh virtualenv, it runs the
agent, the allocator and the CLI from ``/`` with no repository on the path and no
``LEASEHOLD_LUA_DIR`` — the Lua scripts, the sample policies and the etcd roles script come from
the package — and it contains no chaos suite, benchmarks, documentation tools or tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from kernel.version import __version__
from leasehold.local.procs import Proc, free_port, wait_http_ready

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("chaos/", "bench/", "devtools/", "tests/")
# a module of the wheel that imports a development-only package would fail on an operator's machine
DEV_IMPORT = re.compile(r"^\s*(?:from|import)\s+(chaos|devtools|tests|bench)\b", re.M)


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # build from a clean copy: an in-tree build would write build/ and *.egg-info into the checkout
    src = out / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", ".run", "chaos-reports", "bench-results", "__pycache__",
        ".hypothesis", ".pytest_cache", "node_modules", "secrets"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out / "dist"), str(src)])
    (path,) = (out / "dist").glob("leasehold-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path) -> Path:
    venv = wheel.parent / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    _run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"), str(wheel)])
    return venv


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LEASEHOLD_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def test_wheel_holds_the_product_and_no_development_code(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        sources = {n: z.read(n).decode() for n in names if n.endswith(".py")}
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert not [n for n in names if n.startswith(DEV_ONLY)], "development code in the runtime wheel"
    assert not {n: m.group(0) for n, s in sources.items() if (m := DEV_IMPORT.search(s))}
    lua = {n for n in names if n.startswith("region_agent/lua/") and n.endswith(".lua")}
    assert len(lua) == len(list((ROOT / "lua").rglob("*.lua")))
    assert {f"kernel/policies/{p.name}" for p in (ROOT / "policies").glob("*.json")} <= set(names)
    assert {"leasehold/commands/cli.py", "leasehold/local/etcd_roles.sh", "leasehold/local/gateway_configs/envoy-rls.yaml",
            "region_agent/__main__.py", "allocator/__main__.py", "kernel/version.py"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert f"\nVersion: {__version__}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    for extra in ("demo", "test", "bench"):
        assert f"Provides-Extra: {extra}" in meta
    # the runtime requirements carry no test-only binaries (those come with the extras)
    runtime = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not [ln for ln in runtime if re.search(r"envoy|traefik|pytest|schemathesis|hypothesis", ln)]


def test_wheel_carries_scripts_and_samples(wheel_venv: Path):
    py = str(wheel_venv / "bin" / "python")
    probe = ("import region_agent, kernel.resources as r; from region_agent.store.scripts import Scripts;"
             "s = Scripts(); print(region_agent.__file__); print(s.lua_dir);"
             "print(len([n for n in s.scripts if '[' not in n]));"  # the files, not their lean variants
             "print(r.sample_policy('northstar-global.json').is_file());"
             "import importlib.util as u; print([m for m in ('chaos', 'devtools', 'bench')"
             " if u.find_spec(m.split('.')[0]) and u.find_spec(m)])")
    lines = _run([py, "-c", probe], cwd="/", env=_clean_env()).stdout.splitlines()
    site = str(wheel_venv)
    assert lines[0].startswith(site) and not lines[0].startswith(str(ROOT)), lines  # the installed copy
    assert lines[1].startswith(site), lines  # scripts from the package, not the repository
    assert int(lines[2]) == len(list((ROOT / "lua").glob("*.lua")))
    assert lines[3] == "True"
    assert lines[4] == "[]"  # no chaos, documentation tools or benchmarks importable from the install


def test_every_entry_point_of_the_wheel_prints_its_version(wheel_venv: Path):
    bin_ = wheel_venv / "bin"
    env = _clean_env(LEASEHOLD_BUILD_COMMIT="0123456789abcdef0123")
    for argv, prog in (([str(bin_ / "leasehold")], "leasehold"),
                       ([str(bin_ / "python"), "-m", "region_agent"], "python -m region_agent"),
                       ([str(bin_ / "python"), "-m", "allocator"], "python -m allocator")):
        out = _run([*argv, "--version"], cwd="/", env=env).stdout.strip()
        assert out == f"{prog} {__version__} (commit 0123456789ab)", out
    # a wheel outside a checkout and without the variable does not pretend to know its commit
    out = _run([str(bin_ / "leasehold"), "--version"], cwd="/", env=_clean_env()).stdout.strip()
    assert out == f"leasehold {__version__} (commit unknown)"


def test_agent_from_wheel_admits_from_root(wheel_venv: Path, redis_url: str, tmp_path: Path):
    port = free_port()
    argv = [str(wheel_venv / "bin" / "python"), "-m", "region_agent", "--redis-url", redis_url,
            "--region", "eu", "--host", "127.0.0.1", "--port", str(port), "--policy-poll-ms", "0",
            "--insecure-dev-pepper", "--auth-disabled"]  # default policy: the shipped sample
    env = _clean_env(LEASEHOLD_BUILD_COMMIT="feedfacecafe")
    proc = Proc("agent-wheel", argv, tmp_path / "agent", env=env, cwd="/").start()
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
        metrics = httpx.get(base + "/metrics", timeout=5).text
        assert f'leasehold_build_info{{commit="feedfacecafe",version="{__version__}"}} 1.0' in metrics
    finally:
        proc.stop()


def test_cli_from_wheel_runs_a_topology_from_root(wheel_venv: Path, tmp_path: Path):
    """``leasehold up`` of the installed wheel starts etcd, an allocator and an agent (the wheel's
    own ``python -m allocator`` / ``region_agent``, the etcd roles script from the package, tokens,
    pepper and a signing key generated), and ``status`` / ``admit`` / ``down`` work against it."""
    cli = str(wheel_venv / "bin" / "leasehold")
    run_dir = tmp_path / "run"
    env = _clean_env()
    common = [cli, "--run-dir", str(run_dir)]
    _run([*common, "up", "--regions", "eu", "--allocators", "1"], cwd="/", env=env)
    try:
        state = json.loads((run_dir / "topology.json").read_text())
        for svc in state["services"]:
            if svc["kind"] in ("agent", "allocator"):
                cmd = Path(f"/proc/{svc['pid']}/cmdline").read_bytes().split(b"\0")
                assert cmd[0].decode().startswith(str(wheel_venv)), cmd  # the wheel's interpreter
        status = _run([*common, "status"], cwd="/", env=env).stdout
        assert re.search(r"agent .* ready", status) and re.search(r"allocator .* ready", status), status
        admit = subprocess.run([*common, "-o", "json", "admit", "--tenant", "atlas", "--principal", "U-17"], cwd="/", env=env,
                               capture_output=True, text=True, timeout=60)
        assert admit.returncode == 0, admit.stdout + admit.stderr
        assert json.loads(admit.stdout)["allowed"] is True
        alloc = next(s["url"] for s in state["services"] if s["kind"] == "allocator")
        assert 'leasehold_build_info{commit="unknown"' in httpx.get(alloc + "/metrics", timeout=5).text
    finally:
        down = subprocess.run([*common, "down"], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
