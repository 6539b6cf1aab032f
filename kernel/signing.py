"""Signed policy bundles ("gateways accept only signed, versioned bundles": docs/invariants.md I13).

The checksum detects corruption; a signature detects forgery by anyone who can write the
bundle file or the etcd key. Ed25519 (the ``cryptography`` package).

**What is signed.** ``signed_message(bundle)`` is the ASCII domain tag
``leasehold-policy-bundle/v1`` and a newline, followed by the canonical JSON (sorted keys, no
whitespace, every field including defaults — the same encoding the checksum covers) of::

    {"bundleVersion", "keyId", "maxAgeMs", "pools", "publishedAt", "rules"}

that is: everything the checksum covers (rules, pools, maxAgeMs) **plus the version**, so a
signed bundle cannot be replayed under another ``bundleVersion`` (a rollback is a new version
and needs a new signature), plus ``publishedAt`` and the ``keyId`` itself. Only ``checksum``
(derived from the covered content) and ``signature`` are outside it.

**Key ids.** ``keyId`` is the first 16 hex digits of sha256 of the raw 32-byte public key:
computed, never chosen, so a trusted-key list cannot carry two names for one key. A bundle
carries ``"keyId"`` and ``"signature": "ed25519:<base64>"`` (both or neither).

**Verification** (:class:`TrustedKeys`): with no trusted keys configured every valid bundle is
accepted (signatures not required); with keys configured a bundle is refused as

* ``unsigned`` - it carries no signature,
* ``untrusted_key`` - its keyId is not one of the trusted keys,
* ``bad_signature`` - the signature does not verify (tampered after signing, or a forged keyId).

**Verified first.** :meth:`TrustedKeys.check` reads only what decoding into the schema gives
(``kernel.bundle.decode_schema``): the ``keyId``, the ``signature`` and the fields
:func:`signed_message` encodes. None of the validation's checks (the checksum, the rules' and
pools' problems, every request's rule set) is needed to verify, so the services verify before they
validate (``kernel.bundle.decode_bundle``'s ``verify``): a bundle no trusted key signed costs a
decode and one verification, and is refused with its signature outcome even when it is also
invalid (docs/decisions/0079).

Key rotation is two trusted keys at once (docs/policy.md, "Signed policy bundles").
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .bundle import Bundle, rule_doc
from .errors import PolicyError

DOMAIN = b"leasehold-policy-bundle/v1\n"
PREFIX = "ed25519:"
REFUSALS = ("unsigned", "untrusted_key", "bad_signature")


class SignatureRefused(PolicyError):
    """A bundle refused for its signature; ``outcome`` is one of :data:`REFUSALS`."""

    code, title = "policy-signature", "Policy bundle signature refused"

    def __init__(self, outcome: str, detail: str):
        super().__init__(detail)
        self.outcome = outcome


# ------------------------------------------------------------------------------ message
def signed_message(bundle: Bundle, key_id: str | None = None) -> bytes:
    """The exact bytes an Ed25519 signature of ``bundle`` covers (see the module doc)."""
    doc = {
        "bundleVersion": bundle.bundle_version,
        "keyId": bundle.key_id if key_id is None else key_id,
        "maxAgeMs": bundle.max_age_ms,
        "pools": [msgspec.to_builtins(p) for p in bundle.pools],
        "publishedAt": bundle.published_at,
        "rules": [rule_doc(r) for r in bundle.rules],
    }
    if bundle.tenant_splits:  # (absent from the bytes of a bundle without splits: old signatures verify)
        doc["tenantSplits"] = [msgspec.to_builtins(s) for s in bundle.tenant_splits]
    return DOMAIN + msgspec.json.encode(doc, order="sorted")


def key_id_of(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_bundle(bundle: Bundle, private: Ed25519PrivateKey) -> Bundle:
    """``bundle`` (already sealed) with ``keyId`` and ``signature`` set."""
    kid = key_id_of(private.public_key())
    sig = private.sign(signed_message(bundle, kid))
    return msgspec.structs.replace(bundle, key_id=kid, signature=PREFIX + base64.b64encode(sig).decode())


# ------------------------------------------------------------------------------ keys
def generate_keypair(directory: Path, name: str = "policy-signing", *, replace: bool = False) -> tuple[Path, Path]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (SubjectPublicKeyInfo PEM)
    into ``directory``; returns their paths. An existing key or public key is a
    :class:`FileExistsError` (a fleet may trust it: replacing it loses the key that signs what the
    fleet accepts) unless ``replace``, which writes both afresh (the key 0600 whatever it was)."""
    directory.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    there = [p for p in (key_path, pub_path) if p.exists() or p.is_symlink()]
    if there and not replace:
        raise FileExistsError(f"{' and '.join(str(p) for p in there)} already exist{'s' if len(there) == 1 else ''}")
    for p in there:
        p.unlink()
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    with open(pub_path, "xb") as f:
        f.write(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_path, pub_path


def _load_pem(path: str | Path, what: str, load: Callable[[bytes], object], form: str) -> object:
    """The key in the PEM file ``path``, or a PolicyError naming the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PolicyError(f"cannot read the {what} {str(path)!r}: {e.strerror}") from None
    try:
        key = load(data)
    except (ValueError, TypeError) as e:
        raise PolicyError(f"{str(path)!r} is not {form}: {e}") from None
    return key


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    key = _load_pem(path, "signing key", lambda d: serialization.load_pem_private_key(d, password=None),
                    "an unencrypted PEM private key")
    if not isinstance(key, Ed25519PrivateKey):
        raise PolicyError(f"{str(path)!r} is not an Ed25519 private key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    key = _load_pem(path, "public key", serialization.load_pem_public_key, "a PEM public key")
    if not isinstance(key, Ed25519PublicKey):
        raise PolicyError(f"{str(path)!r} is not an Ed25519 public key")
    return key


def public_key_text(public: Ed25519PublicKey) -> str:
    """Raw public key as base64 (what the etcd signing marker stores)."""
    return base64.b64encode(public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)).decode()


def public_key_from_text(text: str) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except ValueError as e:
        raise PolicyError(f"not a base64 raw Ed25519 public key: {e}") from None


# ------------------------------------------------------------------------------ verification
class TrustedKeys:
    """The public keys a service accepts bundle signatures from (``--policy-public-keys``)."""

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()):
        self.keys: dict[str, Ed25519PublicKey] = {key_id_of(k): k for k in keys}

    @classmethod
    def from_files(cls, paths: Iterable[str]) -> TrustedKeys:
        return cls(load_public_key(p) for p in paths)

    @property
    def required(self) -> bool:
        """Signatures are required as soon as one key is trusted."""
        return bool(self.keys)

    def ids(self) -> list[str]:
        return sorted(self.keys)

    def check(self, bundle: Bundle) -> None:
        """Raise :class:`SignatureRefused` unless ``bundle`` is acceptable (see the module doc)."""
        if not self.keys:
            return
        v = bundle.bundle_version
        if bundle.signature is None or bundle.key_id is None:
            raise SignatureRefused("unsigned", f"bundle {v} is unsigned and signatures are required "
                                               f"(trusted keys: {', '.join(self.ids())})")
        key = self.keys.get(bundle.key_id)
        if key is None:
            raise SignatureRefused("untrusted_key", f"bundle {v} is signed by key {bundle.key_id}, which is not "
                                                    f"trusted (trusted keys: {', '.join(self.ids())})")
        try:
            sig = base64.b64decode(bundle.signature.removeprefix(PREFIX), validate=True)
            key.verify(sig, signed_message(bundle))
        except (InvalidSignature, ValueError):
            raise SignatureRefused("bad_signature", f"bundle {v}: the signature of key {bundle.key_id} does not "
                                                    "verify (changed after signing, or not signed by that key)"
                                   ) from None
