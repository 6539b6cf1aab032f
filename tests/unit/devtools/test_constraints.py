"""constraints.txt is what the tests run with: every distribution of this venv is pinned at its
installed version, and every requirement of pyproject.toml is pinned inside its range."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from devtools import constraints


def test_the_venv_runs_the_pinned_versions():
    bad = constraints.problems(constraints.read(), constraints.installed(),
                               constraints.requirements() + constraints.build_requirements())
    assert not bad, "\n".join(bad) + "\n(after a deliberate upgrade: make constraints)"


def test_a_drift_or_a_pin_outside_the_range_is_reported(tmp_path: Path):
    pins = {"redis": "8.1.0", "uvicorn": "0.54.0"}
    assert constraints.problems(pins, {"redis": "8.1.0"}, [Requirement("redis>=5.2,<8.2")]) == []
    assert constraints.problems(pins, {"redis": "8.2.0"}, []) == \
        ["redis: constraints.txt pins 8.1.0, the venv has 8.2.0"]
    assert constraints.problems(pins, {"httpx": "0.28.1"}, []) == \
        ["httpx 0.28.1 is installed but not in constraints.txt"]
    assert constraints.problems(pins, {}, [Requirement("uvicorn>=0.30,<0.54")]) == \
        ["constraints.txt pins uvicorn==0.54.0, outside pyproject.toml's uvicorn<0.54,>=0.30"]
    assert constraints.problems(pins, {}, [Requirement("rich>=13")]) == \
        ["rich>=13 (pyproject.toml) is not pinned in constraints.txt"]
    f = tmp_path / "c.txt"
    f.write_text("# comment\nRedis==8.1.0\n")
    assert constraints.read(f) == {"redis": "8.1.0"}
    f.write_text("redis>=8\n")
    try:
        constraints.read(f)
    except ValueError as e:
        assert "not a name==version pin" in str(e)
    else:
        raise AssertionError("a range in constraints.txt must be refused")


def test_every_capped_dependency_is_capped_in_pyproject():
    """The dependencies whose private internals the code touches carry an upper bound."""
    reqs = {r.name: r for r in constraints.requirements()}
    for name in ("redis", "hiredis", "uvicorn", "httptools", "aetcd", "protobuf", "grpcio"):
        spec = reqs[name].specifier
        assert any(s.operator in ("<", "==") for s in spec), f"{name} has no upper bound: {spec}"


def test_the_build_backend_is_pinned_for_the_image_build():
    """pyproject.toml's ``setuptools>=77`` was fetched unconstrained into the image build's isolated
    environment (whatever setuptools was newest that day built the wheel): constraints.txt pins
    it, inside the range, and ``--write`` keeps the pin (the venv does not have it)."""
    pins = constraints.read()
    for req in constraints.build_requirements():
        assert req.name in pins and req.specifier.contains(pins[req.name]), req
    assert constraints.problems({}, {}, [Requirement("setuptools>=77")]) == \
        ["setuptools>=77 (pyproject.toml) is not pinned in constraints.txt"]


def test_the_file_is_what_write_writes():
    """``make constraints`` rewrites the file from the venv: a hand edit it would undo (an order, a
    note) is a diff waiting for the next upgrade. (Its build-backend note was lost that way.)"""
    build = frozenset(canonicalize_name(r.name) for r in constraints.build_requirements())
    assert constraints.render(constraints.read(), build) == constraints.FILE.read_text()
