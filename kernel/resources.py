"""Files that ship inside the package: the sample policy bundles.

``kernel/policies`` is a symlink to the repository's top-level ``policies/`` folder, copied
as regular files into a wheel, so a non-editable install finds the samples without the
repository. Read through :mod:`importlib.resources`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SAMPLES = ("northstar.json", "northstar-global.json")


def policies_dir() -> Path:
    return Path(str(resources.files("kernel").joinpath("policies")))


def sample_policy(name: str) -> Path:
    """Path of a shipped sample bundle, e.g. ``sample_policy("northstar.json")``."""
    if name not in SAMPLES:
        raise ValueError(f"unknown sample policy {name!r}; known: {', '.join(SAMPLES)}")
    return policies_dir() / name


def resolve_policy_path(path: str) -> str:
    """A policy path as given, or — when it is the relative default ``policies/<sample>`` and
    no such file exists under the working directory — the shipped sample of that name."""
    p = Path(path)
    if p.exists() or p.is_absolute() or p.parent != Path("policies") or p.name not in SAMPLES:
        return path
    return str(sample_policy(p.name))
