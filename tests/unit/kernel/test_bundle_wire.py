"""The bundle's JSON did not change when a rule became one Struct per algorithm:
existing files decode, are written back byte for byte, keep their checksums, and bundles signed
before still verify. ``fixtures/*.signed.json`` were signed (with ``fixtures/flat-format.pub.pem``'s
key) by the code from before the change, when a rule was one flat Struct."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from chaos.bundles import chaos_bundle
from kernel.algorithms import ALGORITHMS, KINDS
from kernel.bundle import (
    FLAT_RULE_FIELDS,
    Bundle,
    Pool,
    decode_bundle,
    encode_bundle,
    load_bundle_file,
    make_rule,
    seal,
)
from kernel.errors import PolicyError
from kernel.resources import SAMPLES, sample_policy
from kernel.signing import SignatureRefused, TrustedKeys, load_public_key

FIXTURES = Path(__file__).parent / "fixtures"
SIGNED = sorted(FIXTURES.glob("*.signed.json"))

# checksums the flat-Struct code computed for bundles built in code (chaos run, bench figure 6)
BUILT_BEFORE = {
    "chaos": "sha256:313f4cb3d72fc5026df9e9a74e9fd53486a5f34610b685d42d640707f557a71b",
    "bench-util-2000": "sha256:b82b71e943a0a43c35801ec0d6bad1568d08245b33b915cfb2b920b36f86f3ff",
}


@pytest.mark.parametrize("name", SAMPLES)
def test_samples_decode_and_are_written_back_byte_for_byte(name: str):
    raw = sample_policy(name).read_bytes()
    bundle = decode_bundle(raw)
    assert encode_bundle(bundle) + b"\n" == raw
    assert {type(r).algorithm for r in bundle.rules} <= set(ALGORITHMS)


@pytest.mark.parametrize("name", SAMPLES)
def test_resealing_a_sample_keeps_its_checksum(name: str):
    bundle = load_bundle_file(str(sample_policy(name)))
    assert seal(bundle).checksum == bundle.checksum


def bench_util_bundle_before(window_ms: int) -> Bundle:
    """Bench figure 6's bundle as it was built when BUILT_BEFORE was computed (one tenant pool; the
    figure has since gained a global-scope pool)."""
    pool = Pool(id="util", window_ms=window_ms, limit=200, lease_ttl_ms=min(1_000, window_ms), chunk_min=5,
                chunk_max=50, fallback_per_region=10, prefetch_ms=min(500, window_ms // 4),
                active_horizon_ms=window_ms)
    rule = make_rule(id="tenant-t0-util", scope="tenant", tenant="t0", algorithm="pool", pool="util", cost=1,
                     fail_mode="local_bounded")
    return seal(Bundle(bundle_version=1, published_at="2026-11-29T00:00:00Z", checksum="", rules=[rule],
                       pools=[pool]))


def test_bundles_built_in_code_seal_as_before():
    assert chaos_bundle().checksum == BUILT_BEFORE["chaos"]
    assert bench_util_bundle_before(2_000).checksum == BUILT_BEFORE["bench-util-2000"]


@pytest.mark.parametrize("path", SIGNED, ids=lambda p: p.name)
def test_bundles_signed_before_still_verify(path: Path):
    bundle = load_bundle_file(str(path))
    TrustedKeys([load_public_key(FIXTURES / "flat-format.pub.pem")]).check(bundle)  # raises if refused
    assert encode_bundle(bundle) + b"\n" == path.read_bytes()


def test_a_tampered_signed_bundle_is_refused():
    doc = msgspec.json.decode(SIGNED[0].read_bytes())
    doc["rules"][0]["capacityMillis"] += 1
    doc["checksum"] = seal(decode_bundle_unchecked(doc)).checksum  # consistent again, signature now stale
    with pytest.raises(SignatureRefused) as e:
        TrustedKeys([load_public_key(FIXTURES / "flat-format.pub.pem")]).check(decode_bundle(msgspec.json.encode(doc)))
    assert e.value.outcome == "bad_signature"


def decode_bundle_unchecked(doc: dict) -> Bundle:
    unsigned = {k: v for k, v in doc.items() if k not in ("keyId", "signature")}
    unsigned["rules"] = [{k: v for k, v in r.items() if v is not None and not (k == "cost" and r["algorithm"] != "pool")}
                         for r in doc["rules"]]
    return msgspec.convert(unsigned, type=Bundle)


def test_compact_rules_without_the_flat_fields_decode_to_the_same_bundle():
    bundle = load_bundle_file(str(sample_policy("northstar-global.json")))
    compact = msgspec.json.encode(bundle)  # msgspec's own encoding: only each algorithm's fields
    assert b'"costMillis":null' not in compact and b'"pool":null' not in compact
    assert decode_bundle(compact) == bundle


def test_a_flat_field_the_algorithm_does_not_have_is_refused_by_name():
    raw = sample_policy("northstar.json").read_bytes().replace(b'"limit": null', b'"limit": 5', 1)
    with pytest.raises(PolicyError) as e:
        decode_bundle(raw)
    assert any("'read-user-v3': limit does not apply to algorithm token_bucket" in p for p in e.value.errors)


def test_unknown_algorithm_and_unknown_field_are_schema_errors():
    raw = sample_policy("northstar.json").read_bytes()
    with pytest.raises(PolicyError, match="algorithm"):
        decode_bundle(raw.replace(b'"algorithm": "token_bucket"', b'"algorithm": "leaky_bucket"', 1))
    with pytest.raises(PolicyError, match="capacityMilis"):
        decode_bundle(raw.replace(b'"capacityMillis": 20000', b'"capacityMilis": 20000', 1))


def test_every_algorithm_is_registered_with_its_kind_and_flat_fields_stay_frozen():
    for name, cls in ALGORITHMS.items():
        assert cls.algorithm == name and KINDS[cls.kind.code] is cls.kind
        assert cls.kind.lib == f"lib/{name}.lua"
    # the flat format's fields are fixed: a new algorithm brings its own fields, never these
    assert set(FLAT_RULE_FIELDS) == {"capacityMillis", "refillMillis", "periodMs", "costMillis", "limit", "windowMs",
                                     "pool", "cost"}


def test_make_rule_builds_the_algorithms_struct():
    r = make_rule(id="x", scope="user", algorithm="sliding_log", limit=3, window_ms=1_000, fail_mode="open")
    assert type(r) is ALGORITHMS["sliding_log"] and r.algorithm == "sliding_log"
    with pytest.raises(ValueError, match="unknown algorithm"):
        make_rule(id="x", scope="user", algorithm="leaky", fail_mode="open")
    with pytest.raises(TypeError):
        make_rule(id="x", scope="user", algorithm="token_bucket", limit=3, fail_mode="open")


def test_a_key_said_twice_is_refused_even_when_the_last_value_is_sealed():
    """A hostile bundle shows a reviewer a rule's burst of 20 and seals the 20,000 written after it: the
    decoder keeps the last value, so the checksum and a signature over it verify. Was accepted with 20,000
    in force; a bundle says each key once (the source refuses a repeated key too)."""
    sample = sample_policy("northstar.json").read_bytes()
    wide = decode_bundle(sample)
    rules = [msgspec.structs.replace(r, capacity_millis=20_000_000) if r.id == "read-user-v3" else r for r in wide.rules]
    raw = encode_bundle(seal(msgspec.structs.replace(wide, rules=rules)))
    shown = raw.replace(b'"capacityMillis": 20000000,', b'"capacityMillis": 20000, "capacityMillis": 20000000,', 1)
    assert shown != raw
    decode_bundle(raw)
    with pytest.raises(PolicyError, match="repeats the key 'capacityMillis' in one object"):
        decode_bundle(shown)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_value_nested_too_deeply_is_a_policy_error(depth: int):
    """Was a RecursionError, which no caller of the decoder handles as a refused bundle."""
    for raw in (b"[" * depth + b"]" * depth, b'{"bundleVersion": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"):
        with pytest.raises(PolicyError, match="nested too deeply"):
            decode_bundle(raw)
