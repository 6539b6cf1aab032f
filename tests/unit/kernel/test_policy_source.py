"""The policy source (YAML with units) and its compilation to the canonical bundle: the sample
sources compile to the committed bundles byte for byte, every bundle decompiles and compiles back
to itself, the schemas in docs/schema are what the types generate, and a broken source is refused
with the file, the line, the rule and the valid values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kernel.algorithms import ALGORITHMS
from kernel.bundle import Bundle, Fallback, Pool, encode_bundle, load_bundle_file, make_rule, seal
from kernel.policy_source import (
    SOURCE_RULES,
    PolicySource,
    SourceError,
    compile_source,
    decompile,
    duration_ms,
    format_duration,
    format_rate,
    millis,
    rate_parts,
)
from kernel.policy_yaml import SourceFileError, bundle_bytes, compile_file, compile_text, source_text

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ROOT / "policies"
SAMPLES = ("northstar", "northstar-global")


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_sources_compile_to_the_committed_bundles(name: str):
    compiled = bundle_bytes(compile_file(POLICIES / f"{name}.yaml"))
    assert compiled == (POLICIES / f"{name}.json").read_bytes()


def test_the_build_check_passes_and_fails_on_a_difference(tmp_path: Path):
    ok = subprocess.run([sys.executable, str(POLICIES / "build.py"), "--check"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    # the check compares bytes: a copy of the tree with one number changed in a source fails it
    import shutil
    copy = tmp_path / "repo"
    for d in ("kernel", "policies", "docs"):
        shutil.copytree(ROOT / d, copy / d, symlinks=True)
    src = copy / "policies" / "northstar.yaml"
    src.write_text(src.read_text().replace("burst: 20\n", "burst: 21\n", 1))
    bad = subprocess.run([sys.executable, str(copy / "policies" / "build.py"), "--check"], capture_output=True,
                         text=True)
    assert bad.returncode == 1 and "policies/northstar.json" in bad.stderr


@pytest.mark.parametrize("name", SAMPLES)
def test_round_trip_compile_decompile_is_the_identity(name: str):
    bundle = load_bundle_file(str(POLICIES / f"{name}.json"))
    again = compile_source(msgspec.convert(decompile(bundle), type=PolicySource))
    assert again == bundle and encode_bundle(again) == encode_bundle(bundle)
    # and through the YAML text
    assert compile_text(source_text(bundle), "x.yaml") == bundle


def test_round_trip_of_every_algorithm_and_every_non_default_field():
    pools = [Pool(id="p1", window_ms=90_000, limit=777, lease_ttl_ms=1_500, chunk_min=3, chunk_max=70,
                  fallback_per_region=9, prefetch_ms=1_250, active_horizon_ms=7_000, chunk_validity_ms=125,
                  regions=["eu", "us"])]
    rules = [
        make_rule(id="tb", scope="user", algorithm="token_bucket", capacity_millis=2_500, refill_millis=250,
                  period_ms=1_500, cost_millis=1_250, fail_mode="local_bounded", route_group="r",
                  fallback=Fallback(capacity_millis=1_001, refill_millis=7, period_ms=333),
                  concurrency_max=2, concurrency_ttl_ms=61_000, concurrency_retry_after_ms=1_001, idempotent=True,
                  decision_ttl_ms=31_000, ttl_slack_ms=0, closed_retry_after_ms=4_999, revocable=True),
        make_rule(id="gc", scope="key", algorithm="gcra", capacity_millis=10_000, refill_millis=3_000,
                  period_ms=86_400_000, cost_millis=1_000, fail_mode="closed", tenant="t1", shadow=True),
        make_rule(id="fw", scope="ip", algorithm="fixed_window", limit=7, window_ms=3_600_000, fail_mode="open",
                  ipv4_prefix=24, ipv6_prefix=48, route_group="login"),
        make_rule(id="sc", scope="route", algorithm="sliding_counter", limit=50, window_ms=2_500, fail_mode="open",
                  route_group="r2"),
        make_rule(id="sl", scope="tenant", algorithm="sliding_log", limit=5, window_ms=1_000, fail_mode="closed",
                  tenant="t2", exempt=True, owner="ops@x"),
        make_rule(id="po", scope="tenant", algorithm="pool", pool="p1", cost=3, fail_mode="local_bounded",
                  tenant="t3"),
    ]
    assert {r.algorithm for r in rules} == set(ALGORITHMS) == set(SOURCE_RULES)
    bundle = seal(Bundle(bundle_version=7, published_at="2030-01-01T00:00:00Z", checksum="", rules=rules,
                         pools=pools, max_age_ms=45_000))
    text = source_text(bundle)
    assert "rate: 0.25/1500ms" in text and "burst: 2.5" in text and "limit: 7/h" in text
    assert compile_text(text, "all.yaml") == bundle


def test_units():
    assert duration_ms("10s") == 10_000 and duration_ms("1min") == 60_000 and duration_ms("0s") == 0
    assert rate_parts("2/s") == (2, 1_000) and rate_parts("20/10s") == (20, 10_000)
    assert millis(0.25, "burst") == 250 and millis(20, "burst") == 20_000
    assert format_rate(250, 1_000) == "0.25/s" and format_rate(1_000_000, 60_000) == "1000/min"
    assert format_rate(20_000, 10_000) == "20/10s" and format_duration(1_500) == "1500ms"
    for bad in ("10", "1.5s", "10 s", "-1s", "10sec"):
        with pytest.raises(SourceError):
            duration_ms(bad)
    with pytest.raises(SourceError, match="more than 3 decimals"):
        millis(0.0001, "burst")


GOOD = (POLICIES / "northstar.yaml").read_text()


def refused(text: str) -> list[str]:
    with pytest.raises(SourceFileError) as e:
        compile_text(text, "p.yaml")
    return e.value.errors


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


@pytest.mark.parametrize(("old", "new", "needle", "expect"), [
    ("algorithm: fixed_window", "algorithm: leaky", "algorithm: leaky",
     "rule 'anon-login': algorithm 'leaky' is not one of fixed_window, gcra, pool, sliding_counter, sliding_log, "
     "token_bucket"),
    ("scope: ip", "scope: anyone", "scope: anyone", "rule 'anon-login': scope 'anyone' is not one of user, key"),
    ("failMode: closed", "failMode: strict", "failMode: strict",
     "rule 'export-tenant': failMode 'strict' is not one of local_bounded, closed, open"),
    ("rate: 2/s", "rate: 2 per second", "rate: 2 per second", "rule 'read-user-v3': rate '2 per second' is not a rate"),
    ("burst: 20\n", "burst: 20.0001\n", "burst: 20.0001", "rule 'read-user-v3': burst 20.0001 has more than 3 decimals"),
    ("cost: 10", "cost: 2000", "cost: 2000", "rule 'export-tenant': costMillis (cost) 2000000 exceeds capacityMillis"),
    ("idempotent: true", "idempotnt: true", "idempotnt", "rule 'export-tenant': unknown field 'idempotnt' (valid here:"),
    ("concurrencyRetryAfter: 5s", "concurrencyRetryAfter: 5", "concurrencyRetryAfter: 5",
     "rule 'export-tenant': concurrencyRetryAfter 5 needs a unit"),
    ("fallback: {limit: 5/10s}", "fallback: {limit: 5}", "fallback: {limit: 5}",
     "rule 'anon-login': fallback limit 5 needs a window"),
    ("tenant: birch", "tenant: Birch", "tenant: Birch", "rule 'tenant-birch-minute': tenant must match"),
    ("  - id: tenant-birch-minute", "  - id: read-user-v3", "  - id: read-user-v3\n    scope: tenant",
     "rule id 'read-user-v3' is used twice"),
])
def test_errors_name_the_file_the_line_the_rule_and_the_valid_values(old, new, needle, expect):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    errors = refused(text)
    line = line_of(text, needle.split("\n")[0]) if "\n" not in needle else text[:text.index(needle)].count("\n") + 1
    assert errors[0].startswith(f"p.yaml:{line}: "), (errors, line)
    assert expect in errors[0], errors


def test_missing_fail_mode_and_structure_errors():
    text = GOOD.replace("    failMode: closed\n", "", 1)
    assert "rule 'export-tenant': failMode is required (one of local_bounded, closed, open)" in refused(text)[0]
    assert refused("")[0].startswith("p.yaml:1: the file is empty")
    assert "not valid YAML" in refused("rules: [\n")[0]
    dup = GOOD.replace("    burst: 20\n", "    burst: 20\n    burst: 21\n", 1)
    assert "'burst' is given twice" in refused(dup)[0]
    assert "version is required" in refused("publishedAt: x\nrules: []\n")[0]


def test_schemas_list_every_algorithm_and_the_units():
    import json
    src = json.loads((ROOT / "docs" / "schema" / "policy-source.schema.json").read_text())
    tags = {d["properties"]["algorithm"]["enum"][0] for d in src["$defs"].values() if "algorithm" in d.get("properties", {})}
    assert tags == set(ALGORITHMS)
    assert src["$defs"]["TokenBucketSource"]["properties"]["rate"]["pattern"].startswith("^(0|[1-9]")
    bundle = json.loads((ROOT / "docs" / "schema" / "bundle.schema.json").read_text())
    assert bundle["$defs"]["FixedWindowRule"]["properties"]["capacityMillis"] == {
        "const": None, "description": "unused by this algorithm (older flat format)"}
