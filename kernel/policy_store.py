"""The policy bundle in etcd: one key, ``<prefix>policy/current``, whose value is the bundle JSON.

Publishing is a compare-and-swap: the new bundle is validated with the services' own code
(:func:`decode_bundle`, checksum included) and written only if its ``bundleVersion`` is
strictly higher than the stored one. The version comparison happens against the value read
just before, and the transaction compares that key's ``mod_revision`` (or its absence), so
a concurrent publish in between makes the transaction fail instead of being overwritten.

**The published version** ``<prefix>policy/published-version`` (``{"bundleVersion": N}``) is the
version of the last bundle a Leasehold tool wrote under the policy key, written in the same
transaction as the bundle by every writer (publish, promote, rollback). Agents hold that version
(or a higher one) once they have read it, and refuse a lower one as older; so a publish must be
above it even when the policy key was deleted or holds a value that is not a bundle — which left a
publish free to write any version, a lower one every agent refused while the operator was told it
was published (docs/decisions/0080).

**A publish is made over a bundle.** A bundle does not record the one it was edited from; its
version says it: bundle N is published over bundle N-1 (what ``leasehold policy bump`` makes of the
published one). A publish whose version skips past the next one must name the bundle it was made
over (``over``), and is written only while that bundle is the published one, so that two operators
editing the same bundle cannot both publish — the second's higher version silently took back the
first's edit.

Rollback is a publish: the old rules and pools under a new, higher ``bundleVersion``
(:func:`rollback_bundle` builds it from any earlier bundle and re-seals the checksum; a signed
fleet needs it signed again, since the signature covers the version).

**The signing marker** ``<prefix>policy/signing`` tells *operator tooling* that the fleet requires
signed bundles and which public keys it trusts: ``{"keys": {"<keyId>": "<base64 raw Ed25519
public key>"}}``. ``leasehold policy publish``, ``canary``, ``promote`` and ``rollback`` refuse a
bundle that is unsigned or does not verify with one of these keys (:meth:`PolicyStore.check_signed`,
which ``stage``, ``promote`` and ``rollback`` call themselves), so a mistake is caught at publish
time rather than by every agent refusing it. The services never read it: their trust comes only from ``--policy-public-keys``,
because write access to etcd must not be enough to change which keys are trusted.

**Verified before validated.** A store made with a service's trusted keys (``trusted``) verifies the
signature of each value it reads as soon as it is decoded into the schema, before the repeated-key
parse, the checksum and the validation (:func:`kernel.bundle.decode_bundle`'s ``verify``): whoever can
write the key but holds no trusted signing key costs a reader a decode and one Ed25519 verification
per value, and the value is refused with the signature's outcome (``Stored.outcome``,
docs/decisions/0079). Without keys every value is validated in full, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kernel.bundle import Bundle, decode_bundle, seal
from kernel.errors import Conflict, NotFound, PolicyError, StaleVersion
from kernel.etcd_store import KV, EtcdStore, EtcdTxnTooLarge, TxnBuilder, Watch
from kernel.signing import SignatureRefused, TrustedKeys

POLICY_KEY_SUFFIX = "policy/current"
SIGNING_KEY_SUFFIX = "policy/signing"
PUBLISHED_VERSION_SUFFIX = "policy/published-version"


def policy_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/current"``."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + POLICY_KEY_SUFFIX.encode()


def signing_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/signing"`` (the signing marker)."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + SIGNING_KEY_SUFFIX.encode()


def published_version_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/published-version"`` (the published version)."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + PUBLISHED_VERSION_SUFFIX.encode()


class PublishedVersion(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    bundle_version: int


def published_version_value(version: int) -> bytes:
    return msgspec.json.encode(PublishedVersion(version))


def _published_version(kv: KV | None) -> int | None:
    """The published version's value; one that is not a record (written by hand) counts as none: the
    policy key's own bundle still bounds what is published, and the next write replaces it."""
    if kv is None:
        return None
    try:
        return msgspec.json.decode(kv.value, type=PublishedVersion).bundle_version
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


class VersionSkip(Conflict):
    """A publish whose version skips past the next one and names no bundle it was made over."""

    code, title = "version-skip", "Bundle version skips the next one"


class SigningMarker(msgspec.Struct, forbid_unknown_fields=True):
    keys: dict[str, str]  # keyId -> base64 raw Ed25519 public key


class BundleTooLarge(PolicyError):
    """A bundle etcd refused for its size (``--max-request-bytes``): retrying cannot help."""

    code, title = "policy-too-large", "Policy bundle too large for etcd"


@dataclass(frozen=True, slots=True)
class Stored:
    """What etcd holds under the policy key: the raw value, its revision and, if it decodes, verifies
    (a store with trusted keys) and validates, the bundle (``bundle`` is None and ``problem`` says why
    otherwise; ``outcome`` then names the refusal as the services count it: ``invalid``, or the
    signature's ``unsigned``, ``untrusted_key``, ``bad_signature``, checked first)."""

    raw: bytes
    mod_revision: int
    bundle: Bundle | None
    problem: str = ""
    outcome: str = "invalid"


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int
    previous: int | None  # None: nothing was published, or what was is not a valid bundle (``replaced``)
    revision: int
    replaced: str = ""  # why the value it replaced was not a valid bundle
    held: int | None = None  # the version it was written above: the published bundle's, or the published version's


def parse_stored(kv: KV, trusted: TrustedKeys | None = None) -> Stored:
    """``kv`` read; with ``trusted`` keys its signature is verified before it is validated."""
    try:
        return Stored(kv.value, kv.mod_revision, decode_bundle(kv.value, verify=_verifier(trusted)))
    except SignatureRefused as e:
        return Stored(kv.value, kv.mod_revision, None, e.detail, e.outcome)
    except PolicyError as e:
        return Stored(kv.value, kv.mod_revision, None, e.detail)


def _keys_of(marker: SigningMarker) -> TrustedKeys:
    """The keys the signing marker names, as a verifier."""
    from kernel.signing import public_key_from_text

    return TrustedKeys(public_key_from_text(v) for v in marker.keys.values())


def _marker_keys(marker: SigningMarker | None) -> TrustedKeys | None:
    return None if marker is None else _keys_of(marker)


def _as_read(*reads: tuple[bytes, KV | None]) -> list[tuple[bytes, int]]:
    """Each (key, what was read there) as :meth:`TxnBuilder.as_read` compares it: its mod_revision, 0
    when the key was absent."""
    return [(key, 0 if kv is None else kv.mod_revision) for key, kv in reads]


def _verifier(trusted: TrustedKeys | None) -> Callable[[Bundle], None] | None:
    return trusted.check if trusted is not None and trusted.required else None


class PolicyStore:
    """Read and publish the bundle under ``<prefix>policy/current``. ``trusted``: the keys of the
    service that reads (``--policy-public-keys``); what it reads is verified before it is validated."""

    def __init__(self, store: EtcdStore, prefix: str = "/leasehold/", *, trusted: TrustedKeys | None = None):
        self.store = store
        self.trusted = trusted
        self.key = policy_key(prefix)
        self.signing_key = signing_key(prefix)
        self.canary_key = canary_key(prefix)
        self.published_version_key = published_version_key(prefix)
        # what the value last read under each key parsed to: a re-read of the same value (a watcher's
        # periodic re-read, a refresh a request asks for) is not decoded, verified and validated again
        self._parsed: dict[bytes, Any] = {}

    def _parse(self, kv: KV, parse: Callable[[KV, TrustedKeys | None], Any]) -> Any:
        hit = self._parsed.get(kv.key)
        if hit is None or hit.mod_revision != kv.mod_revision or hit.raw != kv.value:
            hit = self._parsed[kv.key] = parse(kv, self.trusted)
        return hit

    async def read_signing(self) -> SigningMarker | None:
        """The signing marker, None when the fleet does not declare that it requires signatures.
        Raises StoreUnavailable, or PolicyError when the stored marker is malformed."""
        kv = await self.store.get(self.signing_key)
        if kv is None:
            return None
        try:
            return msgspec.json.decode(kv.value, type=SigningMarker)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
            why = e if not isinstance(e, RecursionError) else "nested too deeply"
            raise PolicyError(f"the signing marker {self.signing_key.decode()} is malformed: {why}") from None

    async def trust_marker(self) -> tuple[SigningMarker | None, str | None]:
        """Read what is stored with the signing marker's keys from now on (verified before validated, as a
        service trusting them reads it). Returns the marker and, when it is malformed (not trusted then),
        why."""
        try:
            marker = await self.read_signing()
        except PolicyError as e:
            return None, e.detail
        if marker is not None:
            self.trusted = _marker_keys(marker)
            self._parsed.clear()
        return marker, None

    async def check_signed(self, bundle: Bundle) -> SigningMarker | None:
        """Refuse ``bundle`` (a :class:`kernel.signing.SignatureRefused`, its ``errors`` saying which keys
        the fleet requires) when the signing marker exists and none of its keys verifies it: what every
        writer of the policy or canary key checks first, so that a bundle the services would refuse is
        refused here. Returns the marker (None: signatures are not required by the store)."""
        marker = await self.read_signing()
        if marker is not None:
            try:
                _keys_of(marker).check(bundle)
            except SignatureRefused as e:
                e.errors.append(f"the fleet requires bundles signed by one of: {', '.join(sorted(marker.keys))} "
                                f"({self.signing_key.decode()}); sign with --key")
                raise
        return marker

    async def write_signing(self, marker: SigningMarker | None) -> None:
        """Set (or, with None, delete) the signing marker."""
        txn = TxnBuilder()
        if marker is None:
            txn.delete(self.signing_key)
        else:
            txn.put(self.signing_key, msgspec.json.encode(marker))
        await self.store.commit(txn)

    async def read_published_version(self) -> int | None:
        """The published version (None: none was written, or the record is not one)."""
        return _published_version(await self.store.get(self.published_version_key))

    async def read(self) -> Stored | None:
        """The stored bundle (None if nothing was ever published). Raises StoreUnavailable."""
        kv = await self.store.get(self.key)
        return None if kv is None else self._parse(kv, parse_stored)

    async def _commit(self, txn: TxnBuilder, body: bytes) -> Any:
        """Commit a transaction that writes ``body``; etcd refusing it for its bytes is the bundle's
        fault, not the store's: :class:`BundleTooLarge` (nothing was written)."""
        try:
            return await self.store.commit(txn)
        except EtcdTxnTooLarge as e:
            if not e.bytes_limit:
                raise
            raise BundleTooLarge(
                f"the bundle is {len(body):,} bytes, more than this etcd accepts in one request "
                f"({e.detail}); nothing was written. etcd's --max-request-bytes is 1.5 MiB by default: "
                "fewer or merged rules, or a larger limit on etcd and on every reader") from None

    async def publish(self, raw: bytes | str, *, over: int | None = None, next_only: bool = False) -> PublishResult:
        """Validate ``raw`` and write it if its version is strictly higher than the published one: the
        valid bundle under the policy key or the published version, whichever is higher (the key may
        have been deleted, or hold a value that is not a bundle, since). ``over``: the version of the
        bundle ``raw`` was made over, which must be the published one; ``next_only`` (the CLI): a
        version that skips past the next one needs ``over``.

        Raises PolicyError (invalid bundle), StaleVersion (not higher), Conflict (made over another
        bundle than the published one, or a concurrent publish changed a key between the read and the
        write), VersionSkip or StoreUnavailable."""
        candidate = decode_bundle(raw)
        body = raw.encode() if isinstance(raw, str) else bytes(raw)
        got = await self.store.get_many([self.key, self.published_version_key])
        cur_kv, mark_kv = got.get(self.key), got.get(self.published_version_key)
        current = None if cur_kv is None else self._parse(cur_kv, parse_stored)
        valid = current.bundle.bundle_version if current is not None and current.bundle is not None else None
        marked = _published_version(mark_kv)
        held = max((v for v in (valid, marked) if v is not None), default=None)
        version = candidate.bundle_version
        if held is not None and version <= held:
            if held == valid:
                raise StaleVersion(f"bundle {version} is not newer than the published {held}")
            why = ("nothing is published there" if current is None else
                   "the published value is not a valid bundle" if current.bundle is None else
                   f"it holds bundle {valid}, written below it since")
            raise StaleVersion(f"bundle {version} is not newer than bundle {held}, the last one published at "
                               f"{self.key.decode()} ({why}): agents hold it and refuse a lower version")
        if over is not None and held is None:
            raise Conflict(f"nothing is published at {self.key.decode()} (nor a published version recorded), not "
                           f"bundle {over} this one was made over: a first bundle is published without --over")
        if over is not None and over != held:
            raise Conflict(f"bundle {held} is published, not bundle {over} this one was made over: publishing it "
                           f"would take back bundle {held}'s changes")
        if over is None and next_only and held is not None and version != held + 1:
            raise VersionSkip(f"bundle {version} skips versions above the published {held}: a bundle is published "
                              "over the one below it unless --over names the bundle it was made over")
        txn = TxnBuilder()
        txn.as_read(_as_read((self.key, cur_kv), (self.published_version_key, mark_kv)))
        txn.put(self.key, body)
        txn.put(self.published_version_key, published_version_value(version))
        res = await self._commit(txn, body)
        if not res.succeeded:
            raise Conflict("the published policy changed during this publish; read it again and retry")
        return PublishResult(version, valid, res.revision,
                             current.problem if current is not None and current.bundle is None else "", held)


    async def watch(self, with_canary: bool = False) -> Watch:
        """An etcd watch of the policy key (and the canary key: both keys, one watch)."""
        if not with_canary:
            return await self.store.watch(self.key)
        low, high = sorted((self.canary_key, self.key))  # policy/canary .. policy/current
        return await self.store.watch(low, high + b"\x00")

    async def read_both(self) -> tuple[Stored | None, StoredCanary | None]:
        """The published bundle and the staged canary, read in one transaction (one revision)."""
        got = await self.store.get_many([self.key, self.canary_key])
        cur, can = got.get(self.key), got.get(self.canary_key)
        return ((None if cur is None else self._parse(cur, parse_stored)),
                (None if can is None else self._parse(can, parse_canary)))


    async def stage(self, raw: bytes, slice_: Slice) -> PublishResult:
        """Write ``raw`` (a validated bundle) as the candidate for ``slice_``. A staged candidate may be
        replaced by a higher version, or by the same bundle with a wider slice, never narrowed (an
        agent never goes back to a lower version for a request it evaluated with the candidate)."""
        candidate = decode_bundle(raw)
        if slice_.empty:
            raise PolicyError("a canary needs a slice: --regions, --agents or --tenants")
        marker = await self.check_signed(candidate)
        got = await self.store.get_many([self.key, self.canary_key, self.published_version_key])
        cur_kv, can_kv = got.get(self.key), got.get(self.canary_key)
        marked = _published_version(got.get(self.published_version_key))
        current = None if cur_kv is None else self._parse(cur_kv, parse_stored)
        # the staged value is verified with the marker's keys before it is validated, as the agents of the slice
        # read it: a candidate none of them signed is held by no agent, so it bounds nothing a new one must be above
        staged = None if can_kv is None else parse_canary(can_kv, _marker_keys(marker))
        if current is not None and current.bundle is None:
            raise PolicyError(f"the published value is not a valid bundle ({current.problem}): publish a valid one "
                              "first, then stage candidates over it")
        problems = canary_problems(current.bundle if current else None, candidate)
        if (marked is not None and candidate.bundle_version <= marked and current is not None
                and current.bundle is not None and current.bundle.bundle_version < marked):
            # the policy key was written below the last published version since (by hand): a promote would take the
            # published version back, so the candidate must be above it, as a publish must
            problems.append(f"bundle {marked} was the last one published ({self.published_version_key.decode()}): the "
                            f"candidate's version {candidate.bundle_version} must be above it")
        if staged is not None and staged.bundle is not None and staged.slice is not None:
            held = staged.bundle
            if candidate.bundle_version < held.bundle_version or (
                    candidate.bundle_version == held.bundle_version and candidate.checksum != held.checksum):
                problems.append(f"bundle {held.bundle_version} is staged: a new candidate needs a higher version "
                                "(or the same bundle, to widen the slice)")
            elif not slice_.covers(staged.slice):
                problems.append(f"the staged slice ({staged.slice.text()}) cannot shrink: agents keep evaluating the "
                                "candidate for it; widen it, promote or roll back")
        if problems:
            raise PolicyError(problems[0], errors=problems)
        assert current is not None and current.bundle is not None
        txn = TxnBuilder()
        txn.as_read(_as_read((self.key, cur_kv), (self.canary_key, can_kv)))
        body = b'{"base":%d,"slice":%s,"bundle":%s}' % (current.bundle.bundle_version, msgspec.json.encode(slice_),
                                                        msgspec.json.encode(msgspec.json.decode(raw)))
        txn.put(self.canary_key, body)
        res = await self._commit(txn, body)
        if not res.succeeded:
            raise Conflict("the published policy or canary changed during this stage; read it again and retry")
        return PublishResult(candidate.bundle_version, current.bundle.bundle_version, res.revision)


    async def _finish_canary(self, raw: bytes | None) -> PublishResult:
        """Promote (``raw`` None: the candidate becomes the published bundle, same bytes, same
        signature; only over the published bundle it was staged over, so a publish made since is
        never taken back) or roll back (``raw``: a bundle with a version above the candidate's): one
        transaction writes the policy key and deletes the canary key."""
        marker = await self.read_signing()
        got = await self.store.get_many([self.key, self.canary_key, self.published_version_key])
        cur_kv, can_kv, mark_kv = got.get(self.key), got.get(self.canary_key), got.get(self.published_version_key)
        if can_kv is None:
            raise NotFound("no canary is staged")
        if cur_kv is None:
            raise NotFound("nothing is published")
        # the published bundle is read as it is (one written before the marker is still the base the candidate
        # was staged over); the candidate is verified with the marker's keys before it is validated, as a
        # service trusting them reads it: one nobody trusted signed is refused for that alone (decision 0079)
        current = self._parse(cur_kv, parse_stored)
        staged = parse_canary(can_kv, _marker_keys(marker))
        marked = _published_version(mark_kv)
        if raw is None:
            if staged.bundle is None:
                if staged.outcome != "invalid":
                    raise SignatureRefused(staged.outcome, f"the staged canary is refused ({staged.outcome}): "
                                                           f"{staged.problem}; roll it back")
                raise PolicyError(f"the staged canary is not a valid bundle ({staged.problem}); roll it back")
            version = staged.bundle.bundle_version
            published = current.bundle
            if marked is not None and version <= marked and (published is None or published.bundle_version < marked):
                now = ("the published value is not a valid bundle now" if published is None else
                       f"bundle {published.bundle_version} was written below it since")
                raise StaleVersion(f"bundle {marked} was the last one published ({now}): the candidate {version} is not "
                                   "newer, and a promote never takes the published version back; roll the canary back")
            if published is not None and version <= published.bundle_version:
                raise StaleVersion(f"bundle {published.bundle_version} was published after the candidate {version} was "
                                   "staged: the candidate is not newer, and agents refuse a lower version; roll the "
                                   "canary back, or stage a candidate above it")
            if published is not None and staged.base != published.bundle_version:
                raise Conflict(f"bundle {published.bundle_version} was published after the candidate {version} was "
                               f"staged over {staged.base}: promoting it would take back that publish's changes; "
                               f"stage a candidate that carries them over {published.bundle_version}, or roll the "
                               "canary back")
            # verified above with the marker's keys (a candidate staged before the marker named other keys, or by hand)
            body = msgspec.json.format(bytes(msgspec.json.decode(staged.raw, type=CanaryDoc).bundle), indent=2)
        else:
            new = decode_bundle(raw)
            floor = max(current.bundle.bundle_version if current.bundle else 0,
                        staged.bundle.bundle_version if staged.bundle else 0, marked or 0)
            if new.bundle_version <= floor:
                raise StaleVersion(f"a rollback needs a version above {floor} (agents of the slice hold the candidate)")
            await self.check_signed(new)
            body, version = bytes(raw), new.bundle_version
        txn = TxnBuilder()
        txn.as_read(_as_read((self.key, cur_kv), (self.canary_key, can_kv), (self.published_version_key, mark_kv)))
        txn.put(self.key, body)
        txn.put(self.published_version_key, published_version_value(version))
        txn.delete(self.canary_key)
        res = await self._commit(txn, body)
        if not res.succeeded:
            raise Conflict("the published policy or canary changed; read it again and retry")
        return PublishResult(version, current.bundle.bundle_version if current.bundle else None, res.revision)


    async def promote(self) -> PublishResult:
        return await self._finish_canary(None)


    async def rollback(self, raw: bytes) -> PublishResult:
        return await self._finish_canary(raw)


def rollback_bundle(old: Bundle, new_version: int, published_at: str) -> Bundle:
    """The content of ``old`` under ``new_version`` (a rollback is a publish of old content)."""
    return seal(msgspec.structs.replace(old, bundle_version=new_version, published_at=published_at))


# ------------------------------------------------------------------------------ staged release
# ``<prefix>policy/canary`` holds a candidate bundle and the slice that evaluates it
# (docs/policy.md, "Canary release"): {"base": <current version when staged>,
# "slice": {"regions": [...], "agents": [...], "tenants": [...]}, "bundle": {<the bundle>}}.
CANARY_KEY_SUFFIX = "policy/canary"


def canary_key(prefix: str) -> bytes:
    """``/leasehold/`` -> ``b"/leasehold/policy/canary"``."""
    return (prefix if prefix.endswith("/") else prefix + "/").encode() + CANARY_KEY_SUFFIX.encode()


class Slice(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Who evaluates a candidate: every request of the named agents and of every agent of the named
    regions, and, on every other agent, the requests of the named tenants."""

    regions: list[str] = []
    agents: list[str] = []
    tenants: list[str] = []

    def covers(self, other: Slice) -> bool:
        return set(self.regions) >= set(other.regions) and set(self.agents) >= set(other.agents) and \
            set(self.tenants) >= set(other.tenants)

    @property
    def empty(self) -> bool:
        return not (self.regions or self.agents or self.tenants)

    def text(self) -> str:
        parts = [f"{k} {', '.join(v)}" for k, v in (("regions", self.regions), ("agents", self.agents),
                                                      ("tenants", self.tenants)) if v]
        return "; ".join(parts) or "nobody"


class CanaryDoc(msgspec.Struct, forbid_unknown_fields=True):
    base: int
    slice: Slice
    bundle: msgspec.Raw


@dataclass(frozen=True, slots=True)
class StoredCanary:
    """The value under the canary key: its revision, slice and, if it decodes, verifies (a store with
    trusted keys) and validates, the candidate (``bundle`` None and ``problem`` say why otherwise,
    ``outcome`` names the refusal as :class:`Stored`'s does)."""

    raw: bytes
    mod_revision: int
    slice: Slice | None
    base: int | None
    bundle: Bundle | None
    problem: str = ""
    outcome: str = "invalid"


def parse_canary(kv: KV, trusted: TrustedKeys | None = None) -> StoredCanary:
    """``kv`` read; with ``trusted`` keys the candidate's signature is verified before it is validated."""
    try:
        doc = msgspec.json.decode(kv.value, type=CanaryDoc)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        why = e if not isinstance(e, RecursionError) else "nested too deeply"
        return StoredCanary(kv.value, kv.mod_revision, None, None, None, f"the canary value is malformed: {why}")
    try:
        return StoredCanary(kv.value, kv.mod_revision, doc.slice, doc.base,
                            decode_bundle(bytes(doc.bundle), verify=_verifier(trusted)))
    except SignatureRefused as e:
        return StoredCanary(kv.value, kv.mod_revision, doc.slice, doc.base, None, e.detail, e.outcome)
    except PolicyError as e:
        return StoredCanary(kv.value, kv.mod_revision, doc.slice, doc.base, None, e.detail)


def canary_problems(current: Bundle | None, candidate: Bundle) -> list[str]:
    """Why ``candidate`` cannot be staged over ``current`` (empty: it can)."""
    out = []
    if current is None:
        out.append("nothing is published yet: publish a first bundle, then stage candidates over it")
        return out
    if candidate.bundle_version <= current.bundle_version:
        out.append(f"the candidate's version {candidate.bundle_version} is not higher than the published "
                   f"{current.bundle_version} (which may hold changes the candidate does not: diff it against "
                   "`leasehold policy show --raw` and carry them over before bumping)")
    if candidate.pools != current.pools:
        out.append("the candidate changes the pools: a pool is one fleet-wide quota held by the allocator and "
                   "cannot be staged for a slice; publish pool changes directly")
    return out
