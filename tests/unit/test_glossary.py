"""docs/glossary.md stays true: the files and code names it cites exist, the wire names it maps are
the ones the structs encode, and the old words it retired do not come back into the code."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import msgspec
import pytest

from kernel.bundle import Bundle
from region_agent.models import AdmitRequest, Decision

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = (ROOT / "docs" / "glossary.md").read_text()
PACKAGES = ("allocator", "bench", "chaos", "devtools", "kernel", "leasehold", "region_agent")

# a term's code name and where it is defined: the glossary names it, the module defines it
CODE_NAMES = [
    ("RedisNode", "region_agent.store.node"),
    ("ClusterStore", "region_agent.store.cluster"),
    ("Store", "region_agent.store.protocol"),
    ("VersionCheck", "region_agent.decision.version_check"),
    ("Snapshot", "region_agent.decision.plan"),
    ("Plan", "region_agent.decision.plan"),
    ("Slot", "region_agent.decision.plan"),
    ("ShardPlan", "allocator.shards"),
    ("SizingPlan", "leasehold.commands.redis_sizing"),
    ("LeaseEvents", "region_agent.leasing.manager"),
    ("FaultRecorder", "chaos.nemesis"),
    ("LeaseRecorder", "chaos.history"),
    ("CallGroup", "region_agent.gateways.call_group"),
    ("DecisionSource", "region_agent.models"),
]

# retired code names and the term each became (docs/decisions/0036-one-name-per-number-wire-names-kept.md)
RETIRED = [
    (r"\bStoreGateway\b", "RedisNode"),
    (r"\bEpochCheck\b", "VersionCheck"),
    (r"\bChunkLease\b", "Chunk"),
    (r"\bkernel[./]bounded\b|from \.bounded import", "kernel.caches"),
    (r"\bregion_agent[./]store[./]gateway\b|from \.gateway import", "region_agent.store.node"),
    (r"\bregion_agent[./]decision[./]epoch\b|from \.epoch import", "region_agent.decision.version_check"),
    (r"(?<!leasehold)\.policy_(?:epoch|version|id)\b", "bundle_version / rule_id"),
    (r"(?<![\w.\"'])policy_(?:epoch|version|id)=(?!=)", "bundle_version / rule_id"),
]


def python_files() -> list[Path]:
    return [p for pkg in (*PACKAGES, "tests") for p in (ROOT / pkg).rglob("*.py")
            if p.name != "test_glossary.py" and "__pycache__" not in p.parts]


@pytest.mark.parametrize("path", sorted(set(re.findall(r"`((?:[\w-]+/)+[\w.-]+\.(?:py|lua|md))`", GLOSSARY))))
def test_every_file_the_glossary_cites_exists(path):
    assert (ROOT / path).exists(), path


@pytest.mark.parametrize(("name", "module"), CODE_NAMES)
def test_every_code_name_of_a_term_is_in_the_glossary_and_defined_where_it_says(name, module):
    assert f"`{name}`" in GLOSSARY, name
    assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_the_wire_names_are_the_ones_the_glossary_maps():
    def encoded(struct: type) -> dict[str, str]:
        return {f.name: f.encode_name for f in msgspec.structs.fields(struct)}

    assert encoded(Decision)["bundle_version"] == "policyVersion"
    assert encoded(Decision)["rule_id"] == "policyId"
    assert encoded(AdmitRequest)["bundle_version"] == "policyEpoch"
    assert encoded(Bundle)["bundle_version"] == "bundleVersion"
    for wire in ("`policyVersion`", "`policyId`", "`policyEpoch`", "`bundleVersion`",
                 "`leasehold_agent_policy_epoch_mismatches_total`"):
        assert wire in GLOSSARY, wire


def test_no_retired_name_is_back_in_the_code():
    found = []
    for p in python_files():
        text = p.read_text()
        for pattern, term in RETIRED:
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{p.relative_to(ROOT)}:{line}: {m.group(0)} (now {term})")
    assert not found, "use the glossary's names (docs/glossary.md):\n" + "\n".join(found)


def test_one_class_per_name_for_plan_and_recorder_and_loggers_by_module():
    defined: dict[str, list[str]] = {}
    loggers = []
    for p in python_files():
        text = p.read_text()
        for m in re.finditer(r"^class (Plan|Recorder)\b", text, re.M):
            defined.setdefault(m.group(1), []).append(str(p.relative_to(ROOT)))
        if p.parts[len(ROOT.parts)] in PACKAGES:
            loggers += [f"{p.relative_to(ROOT)}: {m.group(0)}"
                        for m in re.finditer(r"getLogger\([\"'][^\"']+[\"']\)", text)]
    assert all(len(v) == 1 for v in defined.values()), defined
    assert not loggers, loggers  # getLogger(__name__); the audit channel goes through a constant
