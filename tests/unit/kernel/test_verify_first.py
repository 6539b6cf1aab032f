"""A service that trusts keys verifies a bundle's signature before it validates it (docs/decisions/0079).

Whoever can write the policy key in etcd, but holds no trusted signing key, wrote bundles that every
agent and allocator validated in full before looking at the signature: up to about a second of the
request-set check on each service's event loop per bundle written (tests/support/policies.py
``expensive_bundle``). The validation is now never called for a bundle that does not verify, which is
refused with its signature outcome even when it is invalid too."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import kernel.bundle
from kernel.bundle import Bundle, compute_checksum, decode_bundle, encode_bundle, seal
from kernel.errors import PolicyError
from kernel.etcd_store import KV
from kernel.policy_store import parse_canary, parse_stored
from kernel.signing import SignatureRefused, TrustedKeys, sign_bundle
from tests.support.policies import expensive_bundle, northstar

KEY, ROGUE = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
TRUSTED = TrustedKeys([KEY.public_key()])


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The checks after the schema that ran (the real ones still run: they are recorded, not replaced)."""
    ran: list[str] = []
    for name in ("validate_bundle", "refuse_repeated_keys", "_request_set_problems", "compute_checksum"):
        real = getattr(kernel.bundle, name)

        def spy(*a, _real=real, _name=name, **kw):
            ran.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(kernel.bundle, name, spy)
    yield ran


def tampered(b: Bundle) -> Bundle:
    """Signed by the trusted key, then a rule changed and the checksum computed again."""
    rules = [msgspec.structs.replace(r, capacity_millis=40_000) if r.id == "t0" else r for r in b.rules]
    return msgspec.structs.replace(b, rules=rules, checksum=compute_checksum(rules, b.pools, b.max_age_ms))


EXPENSIVE = expensive_bundle(7)  # (made before any test spies on the checks: sealing computes a checksum)
FORGERIES = {  # what someone who can write the etcd key, but holds no trusted key, can write
    "unsigned": encode_bundle(EXPENSIVE),
    "untrusted_key": encode_bundle(sign_bundle(EXPENSIVE, ROGUE)),
    "bad_signature": encode_bundle(tampered(sign_bundle(EXPENSIVE, KEY))),
}
SIGNED_EXPENSIVE = encode_bundle(sign_bundle(EXPENSIVE, KEY))


def kv(raw: bytes, revision: int = 5) -> KV:
    return KV(b"/leasehold/policy/current", raw, revision, revision, 1)


@pytest.mark.parametrize("outcome", ["unsigned", "untrusted_key", "bad_signature"])
def test_a_bundle_that_does_not_verify_is_refused_before_any_check_of_its_content(outcome: str, checks: list[str]):
    raw = FORGERIES[outcome]
    with pytest.raises(SignatureRefused) as e:
        decode_bundle(raw, verify=TRUSTED.check)
    assert e.value.outcome == outcome
    assert checks == []  # no repeated-key parse, no checksum, no validation, no request-set check


def test_the_expensive_bundle_is_invalid_and_only_the_request_set_check_finds_it(checks: list[str]):
    """What an unsigned fleet (and a signed bundle) still gets: the full validation, as before."""
    with pytest.raises(PolicyError) as e:
        decode_bundle(FORGERIES["unsigned"])
    assert not isinstance(e.value, SignatureRefused)
    assert e.value.errors and all("script slots" in p for p in e.value.errors)
    assert "_request_set_problems" in checks
    checks.clear()
    with pytest.raises(PolicyError) as e:  # signed by the trusted key: verified, then validated in full
        decode_bundle(SIGNED_EXPENSIVE, verify=TRUSTED.check)
    assert not isinstance(e.value, SignatureRefused) and "script slots" in e.value.detail
    assert checks[0] == "refuse_repeated_keys" and "_request_set_problems" in checks


def test_invalid_and_unsigned_is_refused_as_unsigned(checks: list[str]):
    """A checksum that does not match, a repeated key, a rule the schema takes but the validation refuses:
    the service never looks further than the signature."""
    b = northstar()
    wrong_checksum = encode_bundle(msgspec.structs.replace(b, checksum="sha256:" + "0" * 64))
    repeated = encode_bundle(b).replace(b'"bundleVersion": 42', b'"bundleVersion": 41, "bundleVersion": 42', 1)
    assert repeated != encode_bundle(b)
    no_fail_mode = encode_bundle(seal(msgspec.structs.replace(
        b, rules=[msgspec.structs.replace(r, fail_mode=None) for r in b.rules])))
    for raw in (wrong_checksum, repeated, no_fail_mode):
        with pytest.raises(PolicyError) as e:
            decode_bundle(raw)
        assert not isinstance(e.value, SignatureRefused)  # invalid
        checks.clear()
        with pytest.raises(SignatureRefused, match="unsigned"):
            decode_bundle(raw, verify=TRUSTED.check)
        assert checks == []


def test_a_bundle_that_verifies_is_accepted_after_the_whole_validation(checks: list[str]):
    signed = sign_bundle(northstar(), KEY)
    checks.clear()
    assert decode_bundle(encode_bundle(signed), verify=TRUSTED.check) == signed
    assert checks[:2] == ["refuse_repeated_keys", "validate_bundle"]


def test_the_store_names_the_signature_outcome_and_validates_nothing(checks: list[str]):
    """What etcd holds, read with a service's keys: refused with the outcome the services count."""
    for outcome, raw in FORGERIES.items():
        stored = parse_stored(kv(raw), TRUSTED)
        assert stored.bundle is None and stored.outcome == outcome, stored.problem
        canary = parse_canary(kv(b'{"base": 42, "slice": {"regions": ["eu"]}, "bundle": ' + raw + b"}", 6), TRUSTED)
        assert canary.bundle is None and canary.outcome == outcome, canary.problem
    assert checks == []
    # without keys (an unsigned fleet, the CLI's readers): validated as before, refused as invalid
    for trusted in (None, TrustedKeys()):
        stored = parse_stored(kv(FORGERIES["unsigned"]), trusted)
        assert stored.bundle is None and stored.outcome == "invalid" and "script slots" in stored.problem


class _Holds:
    """An etcd holding one value under the policy key (``get``/``get_many`` as the store calls them)."""

    def __init__(self, kv: KV):
        self.kv = kv

    async def get(self, key):
        return self.kv

    async def get_many(self, keys):
        return {self.kv.key: self.kv}


def test_a_value_read_again_is_not_parsed_again(checks: list[str]):
    """The watcher re-reads the key every few seconds (and when a request names a newer policyEpoch): the
    same value was decoded and validated in full at each read, a second of an expensive bundle each time."""
    import asyncio

    from kernel.policy_store import PolicyStore

    etcd = _Holds(kv(SIGNED_EXPENSIVE, 8))
    store = PolicyStore(etcd, trusted=TRUSTED)  # type: ignore[arg-type]  # a fake etcd with the reads the store makes
    first = asyncio.run(store.read())
    assert first is not None and first.bundle is None and first.outcome == "invalid"
    ran = len(checks)
    assert ran and asyncio.run(store.read()) is first and asyncio.run(store.read_both())[0] is first
    assert len(checks) == ran  # read again: nothing decoded, verified or validated
    etcd.kv = kv(FORGERIES["unsigned"], 9)  # a new value: parsed (and refused by its signature alone)
    again = asyncio.run(store.read())
    assert again is not None and again.outcome == "unsigned" and len(checks) == ran
