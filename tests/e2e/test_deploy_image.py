"""deploy/Dockerfile as a container engine reads it (no engine runs here: docs/deployment.md):
the build context is the repository filtered by its ``.dockerignore``; every ``COPY`` of the build
stage takes files that are in that context, and from exactly those files the stage's
``pip install .`` builds a wheel (built here with pip, as the stage does) that carries every module
the shipped manifests run and the files the services load from the package. The context never
holds a credential ``leasehold secrets generate`` wrote (deploy/secrets, deploy/k8s-dev/secrets,
.run/): a classic builder uploads the whole context to the daemon. The runtime stage runs as the
non-root user the manifests name, from a base image pinned to a Debian release and the same in
both stages."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from leasehold.commands.secrets import generate
from tests.support.manifests import DEPLOY, by_kind, kustomize

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = DEPLOY / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore: the last pattern matching the path or one of its parents decides;
    ``!`` re-includes; ``**`` matches any number of directories."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    verdict = False
    for raw in patterns:
        neg = raw.startswith("!")
        pat = raw[1:] if neg else raw
        pat = pat.strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*") \
            .replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            verdict = not neg
    return verdict


def build_context(repo: Path) -> set[str]:
    """The files (relative paths) of the build context of ``repo`` after its .dockerignore."""
    ignore = repo / ".dockerignore"
    patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")] \
        if ignore.exists() else []
    files = set()
    for path in repo.rglob("*"):
        if path.is_file() or path.is_symlink():
            rel = path.relative_to(repo).as_posix()
            if not _ignored(rel, patterns):
                files.add(rel)
    return files


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository as an operator's checkout is after `leasehold secrets generate` for compose
    and the dev overlay (and a `leasehold up`'s .run/secrets)."""
    repo = tmp_path_factory.mktemp("checkout") / "leasehold"
    shutil.copytree(ROOT, repo, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", ".run", "chaos-reports", "bench-results", "__pycache__",
        ".hypothesis", ".pytest_cache", ".mypy_cache", ".ruff_cache", "secrets"))
    generate(repo / "deploy" / "secrets")
    generate(repo / "deploy" / "k8s-dev" / "secrets")
    generate(repo / ".run" / "secrets")
    return repo


def test_the_build_context_holds_no_credential(checkout: Path):
    context = build_context(checkout)
    leaked = sorted(f for f in context if "/secrets/" in f or f.startswith(".run/") or f.endswith(".key"))
    assert not leaked, f"sent to the builder with the context: {leaked[:5]}"


def test_the_build_stage_builds_the_wheel_the_manifests_run_from_its_copies(checkout: Path, tmp_path: Path):
    context = build_context(checkout)
    steps = _instructions()
    froms = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    assert len(froms) == 2, "a build stage and a runtime stage"
    stage = tmp_path / "src"  # the build stage's WORKDIR, filled by its COPY lines
    for op, args in steps[froms[0]:froms[1]]:
        if op != "COPY":
            continue
        *sources, dest = args.split()
        assert not any(s.startswith("--") for s in sources), args
        for src in sources:
            taken = sorted(f for f in context if f == src or f.startswith(src.rstrip("/") + "/"))
            assert taken, f"COPY {src}: not in the build context"
            for f in taken:  # COPY a directory: its contents into dest; a file: into dest/ or as dest
                if f == src:
                    target = stage / dest / Path(f).name if dest.endswith("/") else stage / dest
                else:
                    target = stage / dest / f[len(src.rstrip("/")) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                link = checkout / f
                if link.is_symlink():
                    target.symlink_to(link.readlink())
                else:
                    shutil.copy2(link, target)
    (run,) = [args for op, args in steps[froms[0]:froms[1]] if op == "RUN"]
    assert "-c constraints.txt" in run and " . " in run + " "
    # the build backend too: pip's isolated build environment sees PIP_CONSTRAINT, not -c (pyproject's
    # setuptools>=77 was fetched unpinned); the wheel is built here the same way, with the pinned one
    (workdir,) = [args for op, args in steps[froms[0]:froms[1]] if op == "WORKDIR"]
    assert f"PIP_CONSTRAINT={workdir}/constraints.txt pip install" in run, run
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(stage)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PIP_CONSTRAINT": str(stage / "constraints.txt")})
    assert r.returncode == 0, r.stderr[-2000:]
    pinned = next(line.split("==")[1].split()[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line.startswith("setuptools=="))
    assert re.search(rf"Successfully installed .*setuptools-{re.escape(pinned)}\b", r.stdout + r.stderr), \
        "the wheel was not built with the pinned setuptools"
    (wheel,) = out.glob("leasehold-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module the shipped manifests start
    modules = set()
    rendered = kustomize(DEPLOY / "k8s")
    for kind in ("Deployment", "Job"):
        for d in by_kind(rendered, kind).values():
            for c in d["spec"]["template"]["spec"]["containers"]:
                cmd = c.get("command", [])
                if cmd[:2] == ["python", "-m"]:
                    modules.add(cmd[2])
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    for svc in compose.values():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd[:2] == ["python", "-m"]:
            modules.add(cmd[2])
    assert modules >= {"region_agent", "allocator"}
    for module in modules:
        path = module.replace(".", "/")
        assert f"{path}/__main__.py" in names or f"{path}.py" in names, f"python -m {module}: not in the image's wheel"
    # what the services load from the package
    for needed in ("region_agent/lua/", "kernel/policies/northstar-global.json", "leasehold/local/etcd_roles.sh"):
        assert any(n.startswith(needed) for n in names), needed
    # the CMD is a real entry point
    (cmd,) = [args for op, args in steps[froms[1]:] if op == "CMD"]
    assert yaml.safe_load(cmd)[:3] == ["python", "-m", "region_agent"]
    assert fnmatch.filter(names, "leasehold-*.dist-info/entry_points.txt")


def test_the_runtime_stage_runs_as_the_manifests_user_from_a_pinned_base():
    steps = _instructions()
    first = next(i for i, (op, _) in enumerate(steps) if op == "FROM")
    build_args = dict(a.split("=", 1) for op, a in steps[:first] if op == "ARG" and "=" in a)  # their defaults
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: build_args[m[1]], args.split()[0]) for op, args in steps if op == "FROM"]
    assert len(set(bases)) == 1, f"both stages build on the same base: {bases}"
    assert re.fullmatch(r"python:3\.\d+(\.\d+)?-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?", bases[0]), \
        f"{bases[0]}: pin the Python minor and the Debian release (a bare -slim moves to the next Debian)"
    (user,) = [args for op, args in steps if op == "USER"]
    pods = [d["spec"]["template"]["spec"] for kind in ("Deployment", "Job")
            for d in by_kind(kustomize(DEPLOY / "k8s"), kind).values()]
    assert {str(p["securityContext"]["runAsUser"]) for p in pods} == {user}, "the image's user is the pods' user"
    assert user != "0" and user.isdigit()  # runAsNonRoot can verify a numeric USER
