"""``constraints.txt``: the exact version of every Python distribution the tests ran with, which
``make`` and ``deploy/Dockerfile`` install from (``pip install -c constraints.txt``), so a fresh
machine or image gets what was tested.

    python -m devtools.constraints --write   # from this venv, after a deliberate upgrade (make constraints)
    python -m devtools.constraints --check   # exit 1 and say what differs (tests/unit/devtools runs it)

The check: every distribution installed in this venv (but leasehold itself and pip's own
tooling) is pinned at the version installed, and every requirement of ``pyproject.toml`` (all
extras, and ``[build-system] requires``: the build backend pip fetches into the image build's
isolated environment) is pinned at a version that satisfies it. The build backend's pin is not
this venv's (it builds in isolation): ``--write`` keeps it as the file has it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
FILE = REPO / "constraints.txt"
NOT_PINNED = frozenset({"leasehold", "pip", "setuptools", "wheel"})  # the project and the installer's own tools
HEADER = """\
# The exact versions the tests ran with (python -m devtools.constraints --write; make constraints).
# make and deploy/Dockerfile install with `pip install -c constraints.txt`; pyproject.toml keeps the
# ranges a library user may resolve within. Checked by tests/unit/devtools/test_constraints.py.
"""
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(?:#.*)?$")


def installed() -> dict[str, str]:
    out = {}
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name not in NOT_PINNED:
            out[name] = dist.version
    return out


def read(path: Path = FILE) -> dict[str, str]:
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: not a name==version pin: {line!r}")
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
    return [r for r in reqs if canonicalize_name(r.name) != "leasehold"]


def build_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """``[build-system] requires``: what the image build installs in pip's isolated build environment
    (deploy/Dockerfile applies constraints.txt there through ``PIP_CONSTRAINT``)."""
    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["build-system"]["requires"]]


BUILD_NOTE = "  # [build-system] requires: the image build's isolated environment (PIP_CONSTRAINT)"


def render(versions: dict[str, str], build: frozenset[str] = frozenset()) -> str:
    """The file ``--write`` writes: the header, then a pin per name in name order, the build
    backend's (not in the venv, kept from the file) with a note saying why it is there."""
    return HEADER + "".join(f"{name}=={versions[name]}{BUILD_NOTE if name in build else ''}\n"
                            for name in sorted(versions))


def problems(pins: dict[str, str], have: dict[str, str], reqs: list[Requirement]) -> list[str]:
    out = []
    for name, version in sorted(have.items()):
        if name not in pins:
            out.append(f"{name} {version} is installed but not in constraints.txt")
        elif pins[name] != version:
            out.append(f"{name}: constraints.txt pins {pins[name]}, the venv has {version}")
    for req in reqs:
        name = canonicalize_name(req.name)
        if name not in pins:
            out.append(f"{req} (pyproject.toml) is not pinned in constraints.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            out.append(f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.constraints")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true")
    g.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.write:
        build = frozenset(canonicalize_name(r.name) for r in build_requirements())
        kept = {n: v for n, v in read().items() if n in build} if FILE.exists() else {}
        FILE.write_text(render(installed() | kept, build))
        print(f"wrote {FILE} ({len(read())} pins)")
        return 0
    bad = problems(read(), installed(), requirements() + build_requirements())
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
