"""The policy bundle in etcd: one key, ``<prefix>policy/current``, whose value is the bundle JSON.

Publishing is a compare-and-swap: the new bundle is validated with the services' own code
(:func:`decode_bundle`, checksum included) and written only if its ``bundleVersion`` is
strictly higher than the stored one. The version comparison happens against the value read
just before, and the transaction compares that key's ``mod_revision`` (or its absence), so
a concurrent publish in between makes the transaction fail instead of being overwritten.

Rollback is a publish: the old rules and pools under a new, higher ``bundleVersion``
(:func:`rollback_bundle` builds it from any earlier bundle and re-seals the checksum; a signed
fleet needs it signed again, since the signature covers the version).

**The signing marker** ``<prefix>policy/signing`` tells *operator tooling* that the fleet requires
signed bundles and which public keys it trusts: ``{"keys": {"<keyId>": "<base64 raw Ed25519
public key>"}}``. ``leasehold policy publish`` refuses a bundle that is unsigned or does not verify
with one of these keys, so a mistake is caught at publish time rather than by every agent
refusing it. The services never read it: their trust comes only from ``--policy-public-keys``,
because write access to etcd must not be enough to change which keys are trusted.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kernel.bundle import Bundle, decode_bundle, seal
from kernel.errors import Conflict, PolicyError, StaleVersion
from kernel.etcd_store import KV, EtcdStore, txn_revision

POLICY_KEY_SUFFIX = "policy/current"
SIGNING_KEY_SUFFIX = "policy/signing"


def policy_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/current"``."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + POLICY_KEY_SUFFIX.encode()


def signing_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/signing"`` (the signing marker)."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + SIGNING_KEY_SUFFIX.encode()


class SigningMarker(msgspec.Struct, forbid_unknown_fields=True):
    keys: dict[str, str]  # keyId -> base64 raw Ed25519 public key


@dataclass(frozen=True, slots=True)
class Stored:
    """What etcd holds under the policy key: the raw value, its revision and, if it decodes
    and validates, the bundle (``bundle`` is None and ``problem`` says why otherwise)."""

    raw: bytes
    mod_revision: int
    bundle: Bundle | None
    problem: str = ""


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    previous: int | None
    revision: int


def parse_stored(kv: KV) -> Stored:
    try:
        return Stored(kv.value, kv.mod_revision, decode_bundle(kv.value))
    except PolicyError as e:
        return Stored(kv.value, kv.mod_revision, None, e.detail)


class PolicyStore:
    """Read and publish the bundle under ``<prefix>policy/current``."""

    def __init__(self, store: EtcdStore, prefix: str = "/leasehold/"):
        self.store = store
        self.key = policy_key(prefix)
        self.signing_key = signing_key(prefix)

    async def read_signing(self) -> SigningMarker | None:
        """The signing marker, None when the fleet does not declare that it requires signatures.
        Raises StoreUnavailable, or PolicyError when the stored marker is malformed."""
        kv = await self.store.get(self.signing_key)
        if kv is None:
            return None
        try:
            return msgspec.json.decode(kv.value, type=SigningMarker)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise PolicyError(f"the signing marker {self.signing_key.decode()} is malformed: {e}") from None

    async def write_signing(self, marker: SigningMarker | None) -> None:
        """Set (or, with None, delete) the signing marker."""
        t = self.store.t
        op = t.delete(self.signing_key) if marker is None else t.put(self.signing_key, msgspec.json.encode(marker))
        await self.store.txn([], [op])

    async def read(self) -> Stored | None:
        """The stored bundle (None if nothing was ever published). Raises StoreUnavailable."""
        kv = await self.store.get(self.key)
        return None if kv is None else parse_stored(kv)

    async def publish(self, raw: bytes | str) -> PublishResult:
        """Validate ``raw`` and write it if its version is strictly higher than the stored one.

        Raises PolicyError (invalid bundle), StaleVersion (not higher), Conflict (a concurrent
        publish changed the key between the read and the write) or StoreUnavailable."""
        candidate = decode_bundle(raw)
        body = raw.encode() if isinstance(raw, str) else bytes(raw)
        current = await self.read()
        t = self.store.t
        if current is None:
            compare = [t.version(self.key) == 0]
            previous = None
        else:
            if current.bundle is not None and candidate.bundle_version <= current.bundle.bundle_version:
                raise StaleVersion(f"bundle {candidate.bundle_version} is not newer than the published "
                                   f"{current.bundle.bundle_version}")
            compare = [t.mod(self.key) == current.mod_revision]
            previous = current.bundle.bundle_version if current.bundle is not None else None
        ok, responses = await self.store.txn(compare, [t.put(self.key, body)])
        if not ok:
            raise Conflict("the published policy changed during this publish; read it again and retry")
        return PublishResult(candidate.bundle_version, previous, txn_revision(responses))


def rollback_bundle(old: Bundle, new_version: int, published_at: str) -> Bundle:
    """The content of ``old`` under ``new_version`` (a rollback is a publish of old content)."""
    return seal(msgspec.structs.replace(old, bundle_version=new_version, published_at=published_at))
