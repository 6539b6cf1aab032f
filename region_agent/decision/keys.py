"""Redis key derivation. Pure: no I/O.

Shape: ``rl:v3:{t:<tenant>}:<type>:<principal-hash>:<route>``.

* user       ``rl:v3:{t:T}:u:<h(T, u, userId)>:<route>``
* key        ``rl:v3:{t:T}:k:<h(T, k, apiKeyId)>:<route>``
* route      ``rl:v3:{t:T}:route:T:<route>``
* tenant     ``rl:v3:{t:T}:tenant:T:<route or all>``
* ip         ``rl:v3:{ip:<h(tag prefix)>}:ip:<h(rule prefix)>:<route>`` (anonymous callers)
* decision   ``rl:v3:{t:T}:d:<h(T, d, requestId)>`` (``{ip:..}`` tag for anonymous); the record
  stores the *question* ``h(T, q, type/id/apiKeyId/route/cost)`` it answers
* pool       ``rl:v3:{t:T}:pool:<poolId>`` (tenant balance) / ``rl:v3:{g:<poolId>}:pool:<poolId>`` (fleet-wide)
* cc gate    ``<rule key>:cc``

A tenant split into k sub-buckets (the bundle's ``tenantSplits``, kernel/split.py) has the tags
``{t:T:0}`` .. ``{t:T:<k-1>}`` instead of ``{t:T}``: every key of one request carries the tag of
its principal's sub-bucket (``sub``), the decision record's too.

``<h>`` is HMAC-SHA256(pepper, tenant + "\\x1f" + type + "\\x1f" + id) truncated to 64 bits
(16 hex chars). Tenant ids reach a key only after the one check where a request enters (the wire
types of region_agent.models, or region_agent.decision.plan.check_request for a request built in process:
``[a-z0-9-]{1,32}``, so no ``{``, ``}`` or ``:`` can move a key's hash tag); a key is not derived
for a missing tenant (:class:`ValidationFailed`). The pepper never appears anywhere else.

For anonymous callers all keys of one request must share one hash tag, so the tag hashes the
client address reduced to the *widest* prefix among the request's ip rules; each rule's own
key hashes the address reduced to that rule's prefix (IPv4 /32 and IPv6 /64 by default).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from typing import NamedTuple

from kernel.bundle import Rule
from kernel.caches import BoundedMemo
from kernel.errors import ValidationFailed
from kernel.ids import POOL_ID_RE

NS = "rl:v3"
_SEP = "\x1f"
_TYPE_CODE = {"user": "u", "key": "k"}
_BLOCK = 64  # SHA-256's block size in bytes: HMAC pads its key to it (RFC 2104)


@functools.lru_cache(maxsize=65_536)  # the ipaddress module is slow; a bounded memo of recent callers
def parse_ip(raw: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        addr = ipaddress.ip_address(raw.strip())
    except ValueError:
        raise ValidationFailed("principal.id of an anonymous principal must be an IP address",
                               errors=["principal.id: not an IP address"]) from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@functools.lru_cache(maxsize=65_536)
def ip_prefix(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, v4_bits: int, v6_bits: int) -> str:
    """``str(ip_network(f"{addr}/{bits}", strict=False))`` by integer masking: the network's text
    is its first address and the prefix length, and building it from an int skips the string
    parsing ``ip_network`` does (a cache miss per new caller was a few % of figure 1's CPU)."""
    if addr.version == 4:
        bits = v4_bits
        mask = ((1 << 32) - 1) ^ ((1 << (32 - bits)) - 1)
        return f"{ipaddress.IPv4Address(int(addr) & mask)}/{bits}"
    bits = v6_bits
    mask = ((1 << 128) - 1) ^ ((1 << (128 - bits)) - 1)
    return f"{ipaddress.IPv6Address(int(addr) & mask)}/{bits}"


class KeyTemplate(NamedTuple):
    """A rule's key for one tenant with the principal hash left out: ``head + h(tenant, kind, id) +
    tail`` (``kind`` 'u': the user id, 'k': the API key id), or the whole key in ``tail`` when it
    does not depend on the principal (``kind`` ''). Built once per policy snapshot and selection
    (region_agent.decision.plan.Shape); :meth:`KeyBuilder.key_from` completes it per request and gives the
    key :meth:`KeyBuilder.rule_key` gives (a differential test holds them together)."""

    head: str
    kind: str
    tail: str


class KeyBuilder:
    """Derives every Redis key of the agent under one secret pepper."""

    __slots__ = ("_inner", "_memo", "_outer")

    MEMO_MAX = 50_000  # principal hashes kept (about 10 MB at most; cleared when full)

    def __init__(self, pepper: bytes):
        if not pepper:
            raise ValueError("an empty pepper is not allowed")
        # HMAC-SHA256 (RFC 2104) is SHA-256(K ^ opad || SHA-256(K ^ ipad || msg)), K the pepper
        # padded with zeros to the block (hashed first when longer). The two hashes' states after
        # their pad blocks are the same for every message, so they are made once here and copied
        # per key: the digest ``hmac.digest(pepper, msg, "sha256")`` gives, in less than half its
        # time (the one-shot call sets both pads up again every time; a new caller's keys, its
        # question and its decision record each cost one). A unit test holds the two together.
        key = bytes(pepper)
        if len(key) > _BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        self._memo: BoundedMemo[tuple[str | None, str, str], str] = BoundedMemo(self.MEMO_MAX)

    def __repr__(self) -> str:  # never show the pepper
        return "KeyBuilder(<pepper hidden>)"

    def h(self, tenant: str, kind: str, ident: str) -> str:
        """The principal hash, memoised: a busy principal's keys are derived on every request."""
        k = (tenant, kind, ident)
        v = self._memo.get(k)
        if v is None:
            v = self._memo.put(k, self._hmac(tenant, kind, ident))
        return v

    def _hmac(self, tenant: str, kind: str, ident: str) -> str:
        inner = self._inner.copy()
        inner.update((tenant + _SEP + kind + _SEP + ident).encode("utf-8", "surrogatepass"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:8].hex()  # HMAC-SHA256(pepper, msg) from the pads' states (__init__)

    # --- tags -----------------------------------------------------------------------------
    @staticmethod
    def tenant_tag(tenant: str | None, sub: int | None = None) -> str:
        """``{t:<tenant>}`` of a checked tenant id (module doc); ``{t:<tenant>:<sub>}`` for a split
        tenant's sub-bucket."""
        if tenant is None:
            raise ValidationFailed("tenantId is required for this rule", errors=["tenantId: required"])
        if sub is None:
            return "{t:" + tenant + "}"
        return "{t:" + tenant + ":" + str(int(sub)) + "}"

    def sub_bucket(self, tenant: str, principal_type: str, principal_id: str, k: int) -> int:
        """The sub-bucket of a split tenant (kernel/split.py) a principal's requests spend: a keyed
        hash of the principal, so every agent with the region's pepper picks the same one."""
        return int(self.h(tenant, "s", principal_type + _SEP + principal_id), 16) % k

    def ip_tag(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, rules: list[Rule]) -> str:
        v4 = min((r.ipv4_prefix for r in rules), default=32)
        v6 = min((r.ipv6_prefix for r in rules), default=64)
        return "{ip:" + self.h("", "ip", ip_prefix(addr, v4, v6)) + "}"

    # --- rule keys --------------------------------------------------------------------------
    def rule_key(self, rule: Rule, *, tenant: str | None, user_id: str | None, api_key_id: str | None,
                 route_group: str, ip_tag: str | None = None,
                 addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None, sub: int | None = None) -> str:
        route = rule.route_group or "all"
        if rule.scope == "ip":
            if addr is None or ip_tag is None:
                raise ValidationFailed("an ip rule needs the anonymous caller's address")
            pid = self.h("", "ip", ip_prefix(addr, rule.ipv4_prefix, rule.ipv6_prefix))
            return f"{NS}:{ip_tag}:ip:{pid}:{route}"
        t = tenant
        if t is None:
            raise ValidationFailed("tenantId is required for this rule", errors=["tenantId: required"])
        tag = self.tenant_tag(t, sub)
        if rule.scope == "user":
            if not user_id:
                raise ValidationFailed("a user rule needs a user principal")
            return f"{NS}:{tag}:u:{self.h(t, 'u', user_id)}:{route}"
        if rule.scope == "key":
            if not api_key_id:
                raise ValidationFailed("a key rule needs principal.apiKeyId")
            return f"{NS}:{tag}:k:{self.h(t, 'k', api_key_id)}:{route}"
        if rule.scope == "route":
            return f"{NS}:{tag}:route:{t}:{route}"
        if rule.scope == "tenant":
            return f"{NS}:{tag}:tenant:{t}:{route}"
        raise ValidationFailed(f"scope {rule.scope} has no tenant-tagged key")

    @staticmethod
    def template(rule: Rule, tenant: str | None, sub: int | None = None) -> KeyTemplate | None:
        """The :class:`KeyTemplate` of ``rule``'s key for ``tenant``, or None where it depends on
        more than the principal (ip rules: the address) or the request cannot have it (no valid
        tenant): the caller then derives the key per request (:meth:`rule_key`), which raises."""
        if tenant is None:
            return None
        pool_id = rule.pool_id
        if pool_id is not None:
            if not POOL_ID_RE.fullmatch(pool_id):
                return None
            return KeyTemplate("", "", KeyBuilder.tenant_pool_key(tenant, pool_id))
        route = rule.route_group or "all"
        tag = "{t:" + tenant + "}" if sub is None else "{t:" + tenant + ":" + str(int(sub)) + "}"
        if rule.scope == "user":
            return KeyTemplate(f"{NS}:{tag}:u:", "u", f":{route}")
        if rule.scope == "key":
            return KeyTemplate(f"{NS}:{tag}:k:", "k", f":{route}")
        if rule.scope == "route":
            return KeyTemplate("", "", f"{NS}:{tag}:route:{tenant}:{route}")
        if rule.scope == "tenant":
            return KeyTemplate("", "", f"{NS}:{tag}:tenant:{tenant}:{route}")
        return None

    def key_from(self, t: KeyTemplate, tenant: str | None, user_id: str | None, api_key_id: str | None) -> str:
        """The key of template ``t`` (made for ``tenant``: a template exists only for a tenant) for one principal."""
        if not t.kind:
            return t.tail
        if t.kind == "u":
            if not user_id:
                raise ValidationFailed("a user rule needs a user principal")
            ident = user_id
        else:
            if not api_key_id:
                raise ValidationFailed("a key rule needs principal.apiKeyId")
            ident = api_key_id
        k = (tenant, t.kind, ident)
        v = self._memo.get(k)
        if v is None:
            v = self._memo.put(k, self._hmac(tenant or "", t.kind, ident))
        return t.head + v + t.tail

    @staticmethod
    def unrecorded_decision_key(*, tenant: str | None, ip_tag: str | None = None, sub: int | None = None) -> str:
        """KEYS[1] of a multi-rule call that stores no decision record (decision_ttl_ms 0): the
        script never reads or writes it, it only has to share the call's hash tag, so no HMAC."""
        if ip_tag is not None:
            return f"{NS}:{ip_tag}:d:-"
        return f"{NS}:{KeyBuilder.tenant_tag(tenant, sub)}:d:-"

    def decision_key(self, request_id: str, *, tenant: str | None, ip_tag: str | None = None,
                     sub: int | None = None) -> str:
        # request ids are unique: not memoised
        if ip_tag is not None:
            return f"{NS}:{ip_tag}:d:{self._hmac('', 'd', request_id)}"
        return f"{NS}:{self.tenant_tag(tenant, sub)}:d:{self._hmac(tenant or '', 'd', request_id)}"

    def question(self, *, tenant: str | None, principal_type: str, principal_id: str, api_key_id: str | None,
                 route_group: str, cost_hint: int) -> str:
        """What a decision record answers (``multi_rule.lua``'s question): a keyed hash of the
        tenant, the principal (type, id, API key), the route group and the cost, so a record
        is replayed only to the same question and Redis holds no principal id.

        The fields are joined with the separator, which the principal id and the API key id may
        hold too (they are any text): there the boundary between them would move (user ``P\\x1fK``
        without a key and user ``P`` with the key ``K\\x1f`` asked the same question, and the
        second borrowed the first one's record). Such a question also carries the principal id's
        length, which fixes the boundary (the other fields cannot hold the separator; it has at
        least six separators, any other question exactly four); every other question keeps its
        hash, so the records written before stay replayable."""
        ident = _SEP.join((principal_type, principal_id, api_key_id or "", route_group, str(cost_hint)))
        if _SEP in principal_id or (api_key_id is not None and _SEP in api_key_id):
            ident = _SEP.join((principal_type, str(len(principal_id)), principal_id, api_key_id or "", route_group,
                               str(cost_hint)))
        return self._hmac(tenant or "", "q", ident)

    @staticmethod
    def tenant_pool_key(tenant: str, pool_id: str) -> str:
        if not POOL_ID_RE.fullmatch(pool_id):
            raise ValidationFailed("invalid pool id")
        return f"{NS}:{KeyBuilder.tenant_tag(tenant)}:pool:{pool_id}"

    @staticmethod
    def global_pool_key(pool_id: str) -> str:
        if not POOL_ID_RE.fullmatch(pool_id):
            raise ValidationFailed("invalid pool id")
        return f"{NS}:{{g:{pool_id}}}:pool:{pool_id}"

    @staticmethod
    def pool_fallback_key(balance_key: str) -> str:
        """The region's fallback allowance for a pool balance (same hash tag): tokens admitted
        from ``fallbackPerRegion`` per pool window as the allocator numbers it (a hash by window
        index, ``lua/lib/pool_window.lua``), shared by every agent of the region."""
        head, sep, pool_id = balance_key.rpartition(":pool:")
        if not sep:
            raise ValueError("not a pool balance key")
        return f"{head}:poolfbw:{pool_id}"

    @staticmethod
    def global_pool_refund_key(pool_id: str, refund_id: str) -> str:
        """KEYS[2] of ``pool_refund.lua``: the record that a chunk part's refund ran (same hash tag
        as the pool's balance). ``refund_id``: agent process nonce and part generation."""
        if not POOL_ID_RE.fullmatch(pool_id):
            raise ValidationFailed("invalid pool id")
        if not refund_id or not refund_id.replace("-", "").isalnum():
            raise ValidationFailed("invalid refund id")
        return f"{NS}:{{g:{pool_id}}}:refund:{refund_id}"

    @staticmethod
    def global_pool_decision_key(pool_id: str) -> str:
        """KEYS[1] of a chunk-renewal call (no record is written: decision TTL 0)."""
        return f"{NS}:{{g:{pool_id}}}:d:renew"

    @staticmethod
    def cc_key(rule_key: str) -> str:
        return rule_key + ":cc"


def hash_tag(key: str) -> str:
    """The part Redis Cluster hashes (the first non-empty ``{...}``)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1:end]
    return key
