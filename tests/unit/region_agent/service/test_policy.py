"""region_agent.service.policy: the snapshot in force and its reload rules (files in a temporary
directory; no network)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kernel.bundle import encode_bundle, load_bundle_file, seal
from kernel.signing import SignatureRefused, TrustedKeys, sign_bundle
from region_agent.service.policy import PolicyHolder, ReloadResult

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[4] / "policies" / "northstar.json"))


def version(n: int):
    return seal(msgspec.structs.replace(NORTHSTAR, bundle_version=n))


def write(path: Path, bundle, *, mtime_ns: int) -> None:
    path.write_bytes(encode_bundle(bundle))
    os.utime(path, ns=(mtime_ns, mtime_ns))  # an explicit mtime: the poll must not depend on timer granularity


@pytest.fixture
def holder(tmp_path):
    path = tmp_path / "bundle.json"
    write(path, version(42), mtime_ns=1_000_000_000)
    seen: list[ReloadResult] = []
    return PolicyHolder.load(str(path), on_reload=seen.append), path, seen


def test_offer_accepts_only_a_strictly_newer_version(holder):
    h, _, seen = holder
    assert h.offer(msgspec.structs.replace(version(42), published_at="2030-01-01T00:00:00Z")).outcome == "stale"
    assert h.offer(version(41)).outcome == "stale"
    assert h.bundle.bundle_version == 42
    res = h.offer(version(43))
    assert (res.outcome, res.version) == ("accepted", 43) and h.bundle.bundle_version == 43
    assert [r.outcome for r in seen] == ["stale", "stale", "accepted"]


def test_the_bundle_in_force_offered_again_is_no_refusal(holder):
    """An agent started with the bundle file etcd also holds (`leasehold up`, a Kubernetes ConfigMap
    beside the published key) logged "policy reload refused (stale): bundle 42 is not newer than
    42" and counted a refusal (LeaseholdPolicyRefused) at every start."""
    h, path, seen = holder
    res = h.offer(version(42))
    assert (res.outcome, res.version) == ("unchanged", 42) and seen == []
    write(path, version(42), mtime_ns=3_000_000_000)  # the file touched, its content the same
    assert h.poll().outcome == "unchanged" and seen == []


def test_poll_reloads_only_when_the_file_changed(holder):
    h, path, _ = holder
    assert h.poll() is None
    write(path, version(44), mtime_ns=2_000_000_000)
    res = h.poll()
    assert res is not None and (res.outcome, res.version) == ("accepted", 44)
    assert h.poll() is None  # the same mtime again: nothing to do


def test_an_invalid_file_keeps_the_snapshot_in_force(holder):
    h, path, seen = holder
    path.write_text("{not json")
    os.utime(path, ns=(3_000_000_000, 3_000_000_000))
    res = h.poll()
    assert res is not None and (res.outcome, res.version) == ("invalid", 42) and res.detail
    assert h.bundle.bundle_version == 42 and seen[-1] is res


def test_refuse_counts_without_swapping(holder):
    h, _, seen = holder
    res = h.refuse("corrupt bundle from etcd")
    assert (res.outcome, res.version, res.detail) == ("invalid", 42, "corrupt bundle from etcd")
    signature = h.refuse("bundle 43 is unsigned", "unsigned")  # the store checked the signature first
    assert (signature.outcome, signature.version) == ("unsigned", 42)
    assert seen == [res, signature] and h.bundle.bundle_version == 42


def test_a_file_that_does_not_verify_is_refused_before_it_is_validated(tmp_path, monkeypatch):
    """The bundle file (SIGHUP, mtime poll, the start) is verified before it is validated too: an unsigned
    bundle that is also invalid, and expensive to check, is refused as unsigned and never validated."""
    import kernel.bundle
    from tests.support.policies import expensive_bundle

    key = Ed25519PrivateKey.generate()
    trusted = TrustedKeys([key.public_key()])
    path = tmp_path / "bundle.json"
    write(path, sign_bundle(version(42), key), mtime_ns=1_000_000_000)
    seen: list[ReloadResult] = []
    h = PolicyHolder.load(str(path), trusted=trusted, on_reload=seen.append)
    validated: list[object] = []
    monkeypatch.setattr(kernel.bundle, "validate_bundle", lambda *a, **kw: validated.append(a))
    write(path, expensive_bundle(50), mtime_ns=2_000_000_000)
    res = h.poll()
    assert res is not None and (res.outcome, res.version) == ("unsigned", 42) and "unsigned" in res.detail
    assert validated == [] and seen == [res] and h.bundle.bundle_version == 42
    with pytest.raises(SignatureRefused, match="unsigned"):  # at the start: refused, never validated
        PolicyHolder.load(str(path), trusted=trusted)
    assert validated == []


def test_with_trusted_keys_only_a_bundle_signed_by_one_of_them_is_accepted(tmp_path):
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    trusted = TrustedKeys([key.public_key()])
    path = tmp_path / "bundle.json"
    write(path, sign_bundle(version(42), key), mtime_ns=1_000_000_000)
    h = PolicyHolder.load(str(path), trusted=trusted)
    assert h.offer(version(43)).outcome == "unsigned"
    assert h.offer(sign_bundle(version(43), other)).outcome == "untrusted_key"
    assert h.offer(sign_bundle(version(43), key)).outcome == "accepted"
    write(path, version(50), mtime_ns=1_000_000_000)
    with pytest.raises(SignatureRefused):  # the start bundle is checked too
        PolicyHolder.load(str(path), trusted=trusted)
