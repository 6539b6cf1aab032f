"""Signed bundles (kernel/signing.py): what is signed, and every way a bundle is refused."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kernel.bundle import compute_checksum, decode_bundle, encode_bundle, load_bundle_file, seal
from kernel.errors import PolicyError
from kernel.signing import (
    DOMAIN,
    SignatureRefused,
    TrustedKeys,
    generate_keypair,
    key_id_of,
    load_private_key,
    load_public_key,
    sign_bundle,
    signed_message,
)

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))


@pytest.fixture(scope="module")
def keys():
    return Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()


def refusal(trusted: TrustedKeys, bundle) -> str:
    with pytest.raises(SignatureRefused) as e:
        trusted.check(bundle)
    return e.value.outcome


def test_signed_bundle_round_trips_through_the_file_format_and_verifies(keys):
    a = keys[0]
    signed = sign_bundle(NORTHSTAR, a)
    assert signed.key_id == key_id_of(a.public_key()) and len(signed.key_id) == 16
    again = decode_bundle(encode_bundle(signed))  # keyId and signature survive encoding and validation
    assert again.signature == signed.signature
    TrustedKeys([a.public_key()]).check(again)
    assert b'"keyId"' not in encode_bundle(NORTHSTAR)  # an unsigned bundle carries neither key


def test_the_message_covers_content_version_published_at_and_key_id(keys):
    msg = signed_message(sign_bundle(NORTHSTAR, keys[0]))
    assert msg.startswith(DOMAIN)
    doc = msgspec.json.decode(msg[len(DOMAIN):])
    assert sorted(doc) == ["bundleVersion", "keyId", "maxAgeMs", "pools", "publishedAt", "rules"]
    assert doc["bundleVersion"] == 42 and doc["rules"][0]["capacityMillis"] == 20_000


def test_every_forgery_is_refused_with_its_own_outcome(keys):
    a, b, c = keys
    trusted = TrustedKeys([a.public_key(), b.public_key()])  # two keys: a rotation in progress
    signed = sign_bundle(NORTHSTAR, a)
    trusted.check(signed)
    trusted.check(sign_bundle(NORTHSTAR, b))
    assert refusal(trusted, NORTHSTAR) == "unsigned"
    assert refusal(trusted, sign_bundle(NORTHSTAR, c)) == "untrusted_key"
    # tampered after signing: a rule changed and the checksum recomputed, the signature kept
    rules = [msgspec.structs.replace(r, capacity_millis=200_000) if r.id == "read-user-v3" else r for r in signed.rules]
    tampered = msgspec.structs.replace(signed, rules=rules, checksum=compute_checksum(rules, signed.pools,
                                                                                        signed.max_age_ms))
    decode_bundle(encode_bundle(tampered))  # still a valid bundle: only the signature can tell
    assert refusal(trusted, tampered) == "bad_signature"
    # replayed under another version (the checksum does not cover the version; the signature does)
    assert refusal(trusted, msgspec.structs.replace(signed, bundle_version=43)) == "bad_signature"
    assert refusal(trusted, msgspec.structs.replace(signed, published_at="2030-01-01T00:00:00Z")) == "bad_signature"
    # a trusted key id pasted onto another key's signature
    other = sign_bundle(NORTHSTAR, c)
    assert refusal(trusted, msgspec.structs.replace(other, key_id=signed.key_id)) == "bad_signature"
    TrustedKeys().check(NORTHSTAR)  # no keys configured: signatures are not required


def test_seal_drops_a_signature_and_half_signed_bundles_are_invalid(keys):
    signed = sign_bundle(NORTHSTAR, keys[0])
    assert seal(signed).signature is None and seal(signed).key_id is None
    half = encode_bundle(msgspec.structs.replace(signed, signature=None))
    with pytest.raises(PolicyError, match="keyId and signature go together"):
        decode_bundle(half)
    with pytest.raises(PolicyError, match="signature must be"):
        decode_bundle(encode_bundle(msgspec.structs.replace(signed, signature="ed25519:not-base64")))


def test_key_files(tmp_path: Path):
    key, pub = generate_keypair(tmp_path / "k", "test")
    assert key.stat().st_mode & 0o777 == 0o600
    assert key_id_of(load_private_key(key).public_key()) == key_id_of(load_public_key(pub))
    with pytest.raises(PolicyError, match="not a PEM public key"):
        load_public_key(key)
    with pytest.raises(PolicyError, match="cannot read"):
        load_public_key(tmp_path / "missing.pub")


def test_a_key_pair_is_never_replaced_unless_asked(tmp_path: Path):
    """`leasehold policy keygen DIR` run twice replaced the private key the fleet's trusted public
    key belongs to (and kept an existing file's wider mode): the key that signs bundles, lost."""
    key, pub = generate_keypair(tmp_path, "k")
    before = key.read_bytes(), pub.read_bytes()
    with pytest.raises(FileExistsError, match="k.key and .*k.pub already exist"):
        generate_keypair(tmp_path, "k")
    pub.unlink()
    with pytest.raises(FileExistsError, match="k.key already exists"):  # one of the two is enough
        generate_keypair(tmp_path, "k")
    assert key.read_bytes() == before[0]
    key.chmod(0o644)
    key, pub = generate_keypair(tmp_path, "k", replace=True)
    assert key.read_bytes() != before[0] and key.stat().st_mode & 0o777 == 0o600
    assert key_id_of(load_private_key(key).public_key()) == key_id_of(load_public_key(pub))
