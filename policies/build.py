"""Build the sample policy bundles from their sources, and the JSON Schemas of both formats.

    .venv/bin/python policies/build.py            # writes policies/*.json and docs/schema/*.json
    .venv/bin/python policies/build.py --check    # exit 1 if a committed file differs (make test runs it)

Each ``policies/<name>.yaml`` (the policy source, ``docs/policy.md``) compiles into the sealed
``policies/<name>.json`` the services load (the package ships both). The Northstar bundles
reproduce the worked numbers: P-READ (read-user-v3), P-TENANT (tenant-atlas-minute), P-EXPORT
(export-tenant), P-ANON (anon-login) and tenant Birch.

The schemas are generated from the msgspec Structs (``msgspec.json.schema``): the source's
(``kernel.policy_source.PolicySource``, what editors validate a ``.yaml`` against) and the
bundle's (``kernel.bundle.Bundle``, plus the fields of the older flat rule format that every
bundle file still carries at their fixed values, ``kernel.bundle.FLAT_RULE_FIELDS``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from kernel.bundle import FLAT_RULE_FIELDS, Bundle  # noqa: E402
from kernel.policy_source import PolicySource  # noqa: E402
from kernel.policy_yaml import bundle_bytes, compile_file  # noqa: E402

SOURCES = ("northstar", "northstar-global")
SCHEMA_DIR = ROOT / "docs" / "schema"
SCHEMA_ID = "https://leasehold.dev/schema/"


def _json(doc: object) -> bytes:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"


def source_schema() -> dict[str, Any]:
    schema = msgspec.json.schema(PolicySource)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID + "policy-source.schema.json"
    schema["title"] = "Leasehold policy source (YAML)"
    return schema


def bundle_schema() -> dict[str, Any]:
    schema = msgspec.json.schema(Bundle)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID + "bundle.schema.json"
    schema["title"] = "Leasehold policy bundle (canonical JSON)"
    for name, d in schema["$defs"].items():
        props = d.get("properties", {})
        if not name.endswith("Rule") or "algorithm" not in props:
            continue
        for field, value in FLAT_RULE_FIELDS.items():  # the flat format's unused fields, at their values
            if field not in props:
                props[field] = {"const": value, "description": "unused by this algorithm (older flat format)"}
    return schema


def outputs() -> dict[Path, bytes]:
    out = {HERE / f"{name}.json": bundle_bytes(compile_file(HERE / f"{name}.yaml")) for name in SOURCES}
    out[SCHEMA_DIR / "policy-source.schema.json"] = _json(source_schema())
    out[SCHEMA_DIR / "bundle.schema.json"] = _json(bundle_schema())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = p.parse_args(argv)
    stale = []
    for path, data in outputs().items():
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path.relative_to(ROOT)} is not what `python policies/build.py` writes", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
