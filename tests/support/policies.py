"""The sample policy (``policies/northstar.json``) as a bundle, and as a bundle file."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kernel.bundle import Bundle, encode_bundle, load_bundle_file, seal

ROOT = Path(__file__).resolve().parents[2]
NORTHSTAR = ROOT / "policies" / "northstar.json"


def northstar() -> Bundle:
    return load_bundle_file(str(NORTHSTAR))


def write_bundle(path: Path, bundle: Bundle, **changes: object) -> Bundle:
    """Write ``bundle`` (with ``changes``, sealed again) to ``path``; the bundle written."""
    b = seal(msgspec.structs.replace(bundle, **changes)) if changes else bundle
    path.write_bytes(encode_bundle(b))
    return b


def northstar_file(directory: Path) -> Path:
    """``directory/bundle.json``: the sample bundle."""
    path = directory / "bundle.json"
    write_bundle(path, northstar())
    return path
