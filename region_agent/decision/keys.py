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

``<h>`` is HMAC-SHA256(pepper, tenant + "\\x1f" + type + "\\x1f" + id) truncated to 64 bits
(16 hex chars). Tenant ids are validated against ``[a-z0-9-]{1,32}`` before they reach a key;
anything else raises :class:`ValidationFailed`. The pepper never appears anywhere else.

For anonymous callers all keys of one request must share one hash tag, so the tag hashes the
client address reduced to the *widest* prefix among the request's ip rules; each rule's own
key hashes the address reduced to that rule's prefix (IPv4 /32 and IPv6 /64 by default).
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from typing import NamedTuple

from kernel.bundle import Rule
from kernel.caches import BoundedMemo
from kernel.errors import ValidationFailed
from kernel.ids import POOL_ID_RE, REQUEST_ID_RE, ROUTE_RE, TENANT_RE

NS = "rl:v3"
_SEP = "\x1f"
_TYPE_CODE = {"user": "u", "key": "k"}


# recently validated tenant ids (a key derivation checks several times)
_VALID_TENANTS: BoundedMemo[str, bool] = BoundedMemo(10_000)


def check_tenant(tenant: object) -> str:
    if tenant.__class__ is str and tenant in _VALID_TENANTS:
        return tenant
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise ValidationFailed("tenantId must match [a-z0-9-]{1,32}", errors=["tenantId: invalid"])
    _VALID_TENANTS.put(tenant, True)
    return tenant


# recently validated route groups (every request names one of a few)
_VALID_ROUTES: BoundedMemo[str, bool] = BoundedMemo(1_000)


def check_route(route: object) -> str:
    if route.__class__ is str and route in _VALID_ROUTES:
        return route
    if not isinstance(route, str) or not ROUTE_RE.fullmatch(route):
        raise ValidationFailed("routeGroup must match [a-z0-9_-]{1,32}", errors=["routeGroup: invalid"])
    _VALID_ROUTES.put(route, True)
    return route


def check_ids(request_id: str, route_group: str) -> None:
    """The wire types' checks again, for callers that built a request without decoding one."""
    if not REQUEST_ID_RE.match(request_id):
        raise ValidationFailed("requestId must match [A-Za-z0-9._:-]{8,128}", errors=["requestId: invalid"])
    check_route(route_group)


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

    __slots__ = ("_memo", "_pepper")

    MEMO_MAX = 50_000  # principal hashes kept (about 10 MB at most; cleared when full)

    def __init__(self, pepper: bytes):
        if not pepper:
            raise ValueError("an empty pepper is not allowed")
        self._pepper = bytes(pepper)
        self._memo: BoundedMemo[tuple[str, str, str], str] = BoundedMemo(self.MEMO_MAX)

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
        msg = (tenant + _SEP + kind + _SEP + ident).encode("utf-8", "surrogatepass")
        return hmac.digest(self._pepper, msg, "sha256")[:8].hex()  # one-shot C path of HMAC-SHA256

    # --- tags -----------------------------------------------------------------------------
    @staticmethod
    def tenant_tag(tenant: str) -> str:
        return "{t:" + check_tenant(tenant) + "}"

    def ip_tag(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, rules: list[Rule]) -> str:
        v4 = min((r.ipv4_prefix for r in rules), default=32)
        v6 = min((r.ipv6_prefix for r in rules), default=64)
        return "{ip:" + self.h("", "ip", ip_prefix(addr, v4, v6)) + "}"

    # --- rule keys --------------------------------------------------------------------------
    def rule_key(self, rule: Rule, *, tenant: str | None, user_id: str | None, api_key_id: str | None,
                 route_group: str, ip_tag: str | None = None,
                 addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None) -> str:
        route = rule.route_group or "all"
        if rule.scope == "ip":
            if addr is None or ip_tag is None:
                raise ValidationFailed("an ip rule needs the anonymous caller's address")
            pid = self.h("", "ip", ip_prefix(addr, rule.ipv4_prefix, rule.ipv6_prefix))
            return f"{NS}:{ip_tag}:ip:{pid}:{route}"
        t = check_tenant(tenant)
        tag = self.tenant_tag(t)
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
    def template(rule: Rule, tenant: str | None) -> KeyTemplate | None:
        """The :class:`KeyTemplate` of ``rule``'s key for ``tenant``, or None where it depends on
        more than the principal (ip rules: the address) or the request cannot have it (no valid
        tenant): the caller then derives the key per request (:meth:`rule_key`), which raises."""
        if tenant is None or tenant.__class__ is not str or not TENANT_RE.match(tenant):
            return None
        pool_id = rule.pool_id
        if pool_id is not None:
            if not POOL_ID_RE.fullmatch(pool_id):
                return None
            return KeyTemplate("", "", KeyBuilder.tenant_pool_key(tenant, pool_id))
        route = rule.route_group or "all"
        tag = "{t:" + tenant + "}"
        if rule.scope == "user":
            return KeyTemplate(f"{NS}:{tag}:u:", "u", f":{route}")
        if rule.scope == "key":
            return KeyTemplate(f"{NS}:{tag}:k:", "k", f":{route}")
        if rule.scope == "route":
            return KeyTemplate("", "", f"{NS}:{tag}:route:{tenant}:{route}")
        if rule.scope == "tenant":
            return KeyTemplate("", "", f"{NS}:{tag}:tenant:{tenant}:{route}")
        return None

    def key_from(self, t: KeyTemplate, tenant: str, user_id: str | None, api_key_id: str | None) -> str:
        """The key of template ``t`` (made for ``tenant``) for one principal."""
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
            v = self._memo.put(k, self._hmac(tenant, t.kind, ident))
        return t.head + v + t.tail

    @staticmethod
    def unrecorded_decision_key(*, tenant: str | None, ip_tag: str | None = None) -> str:
        """KEYS[1] of a multi-rule call that stores no decision record (decision_ttl_ms 0): the
        script never reads or writes it, it only has to share the call's hash tag, so no HMAC."""
        if ip_tag is not None:
            return f"{NS}:{ip_tag}:d:-"
        return f"{NS}:{KeyBuilder.tenant_tag(tenant)}:d:-"  # type: ignore[arg-type]  # ip_tag is None only when the plan has a tenant

    def decision_key(self, request_id: str, *, tenant: str | None, ip_tag: str | None = None) -> str:
        # request ids are unique: not memoised
        if ip_tag is not None:
            return f"{NS}:{ip_tag}:d:{self._hmac('', 'd', request_id)}"
        t = check_tenant(tenant)
        return f"{NS}:{self.tenant_tag(t)}:d:{self._hmac(t, 'd', request_id)}"

    def question(self, *, tenant: str | None, principal_type: str, principal_id: str, api_key_id: str | None,
                 route_group: str, cost_hint: int) -> str:
        """What a decision record answers (``multi_rule.lua``'s question): a keyed hash of the
        tenant, the principal (type, id, API key), the route group and the cost, so a record
        is replayed only to the same question and Redis holds no principal id."""
        ident = _SEP.join((principal_type, principal_id, api_key_id or "", route_group, str(cost_hint)))
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
