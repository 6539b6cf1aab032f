"""kernel.policy_store: the policy keys, what a stored value means, rollbacks. Reading and
publishing against etcd: tests/integration (real etcd)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernel.bundle import compute_checksum, encode_bundle, load_bundle_file
from kernel.etcd_store import KV
from kernel.policy_store import parse_stored, policy_key, rollback_bundle, signing_key

NORTHSTAR = load_bundle_file(str(Path(__file__).resolve().parents[3] / "policies" / "northstar.json"))


def test_keys_under_a_prefix_with_or_without_its_slash():
    assert policy_key("/leasehold/") == policy_key("/leasehold") == b"/leasehold/policy/current"
    assert signing_key("/x/") == b"/x/policy/signing"


def test_a_valid_value_is_its_bundle_and_a_corrupt_one_says_why():
    raw = encode_bundle(NORTHSTAR)
    good = parse_stored(KV(key=b"k", value=raw, create_revision=3, mod_revision=9, version=2))
    assert (good.bundle, good.mod_revision, good.problem) == (NORTHSTAR, 9, "")
    bad = parse_stored(KV(key=b"k", value=raw.replace(b'"bundleVersion"', b'"bundleVersionX"'), create_revision=3,
                          mod_revision=10, version=3))
    assert bad.bundle is None and bad.problem and bad.mod_revision == 10


def test_a_rollback_is_the_old_content_under_a_new_sealed_version():
    back = rollback_bundle(NORTHSTAR, 50, "2026-11-30T20:00:00Z")
    assert (back.bundle_version, back.published_at, back.rules) == (50, "2026-11-30T20:00:00Z", NORTHSTAR.rules)
    assert back.checksum == compute_checksum(back.rules, back.pools, back.max_age_ms)


class _RefusesForItsBytes:
    """An etcd that holds nothing and refuses every transaction for its size."""

    def __init__(self, detail: str):
        self.detail = detail

    async def get(self, key):
        return None

    async def get_many(self, keys):
        return {}

    async def commit(self, txn):
        from kernel.etcd_store import EtcdTxnTooLarge
        raise EtcdTxnTooLarge(self.detail)


def test_a_bundle_etcd_refuses_for_its_size_is_the_bundles_fault_not_an_outage():
    import asyncio

    import pytest

    from kernel.errors import PolicyError
    from kernel.policy_store import BundleTooLarge, PolicyStore

    raw = (Path(__file__).resolve().parents[3] / "policies" / "northstar.json").read_bytes()
    fake: Any = _RefusesForItsBytes("etcd txn refused: etcdserver: request is too large")  # get, get_many and commit only
    store = PolicyStore(fake)
    with pytest.raises(BundleTooLarge) as e:
        asyncio.run(store.publish(raw))
    assert isinstance(e.value, PolicyError) and not e.value.retriable  # the CLI's exit 2, not "unavailable"
    assert f"the bundle is {len(raw):,} bytes" in e.value.detail and "nothing was written" in e.value.detail
    fake = _RefusesForItsBytes("etcd txn refused: txn has 200 ops in one branch")
    ops = PolicyStore(fake)
    with pytest.raises(Exception) as other:
        asyncio.run(ops.publish(raw))
    assert not isinstance(other.value, BundleTooLarge)  # too many operations: not the bundle's size
