"""The identity patterns of both services — one set, used by the wire types, the bundle
validation, key derivation and settings.

Every pattern is anchored with ``^`` and ``\\Z``: Python's ``$`` also matches before a trailing
newline, so ``"r-0001\\n"`` would pass a ``$`` pattern (it did on ``/v1/release``). ``PATTERNS``
are the strings (msgspec ``Meta(pattern=...)`` searches with them); the ``*_RE`` objects are the
same patterns compiled; the ``Annotated`` types carry them for msgspec Structs.
"""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import Meta

REQUEST_ID = r"^[A-Za-z0-9._:-]{8,128}\Z"
TENANT_ID = r"^[a-z0-9-]{1,32}\Z"
ROUTE_GROUP = r"^[a-z0-9_-]{1,32}\Z"
METHOD = r"^[A-Z]{1,16}\Z"
RULE_ID = r"^[A-Za-z0-9._-]{1,64}\Z"
POOL_ID = r"^[a-z0-9._-]{1,64}\Z"
REGION = r"^[a-z0-9-]{1,32}\Z"
LEASE_ID = r"^[A-Za-z0-9._:-]{8,96}\Z"
NODE_ID = r"^[A-Za-z0-9._-]{1,64}\Z"
ETCD_PREFIX = r"^/[A-Za-z0-9._/-]*/\Z"
OWNER = r"^[A-Za-z0-9._@-]{1,64}\Z"  # an exempt rule's owner (written into audit events)
KEY_ID = r"^[0-9a-f]{16}\Z"  # a policy-signing key id (kernel.signing)
SIGNATURE = r"^ed25519:[A-Za-z0-9+/]{86}==\Z"  # a bundle signature: base64 of 64 bytes
# the text of a principal or API key id (the identity text): no control character, and no space or
# tab at either end. A gateway hands the id on as a header value, which carries neither as it is: a
# backend's parser trims " admin" into another principal, admin; no gateway forwards a control
# character. Its length is the wire type's (region_agent.models); :func:`is_id_text` checks it. The
# shipped Envoy files' rbac repeats it without the anchors (tests/unit/deploy/test_gateway_identity_patterns.py).
ID_TEXT = r"^[^\x00-\x20\x7f](?:[^\x00-\x1f\x7f]*[^\x00-\x20\x7f])?\Z"

REQUEST_ID_RE = re.compile(REQUEST_ID)
TENANT_RE = re.compile(TENANT_ID)
ROUTE_RE = re.compile(ROUTE_GROUP)
METHOD_RE = re.compile(METHOD)
RULE_ID_RE = re.compile(RULE_ID)
POOL_ID_RE = re.compile(POOL_ID)
REGION_RE = re.compile(REGION)
LEASE_ID_RE = re.compile(LEASE_ID)
NODE_ID_RE = re.compile(NODE_ID)
OWNER_RE = re.compile(OWNER)
KEY_ID_RE = re.compile(KEY_ID)
SIGNATURE_RE = re.compile(SIGNATURE)
ID_TEXT_RE = re.compile(ID_TEXT)

RequestId = Annotated[str, Meta(pattern=REQUEST_ID)]
TenantId = Annotated[str, Meta(pattern=TENANT_ID)]
RouteGroup = Annotated[str, Meta(pattern=ROUTE_GROUP)]
Method = Annotated[str, Meta(pattern=METHOD)]
PoolId = Annotated[str, Meta(pattern=POOL_ID)]
RegionName = Annotated[str, Meta(pattern=REGION)]
LeaseId = Annotated[str, Meta(pattern=LEASE_ID)]
NodeId = Annotated[str, Meta(pattern=NODE_ID)]
EtcdPrefix = Annotated[str, Meta(pattern=ETCD_PREFIX)]


def is_id_text(text: str) -> bool:
    """Whether ``text`` is identity text (``ID_TEXT``). An ASCII string, as ids almost always are, is
    checked without the regex, which a wire type's pattern would run on every question at several
    times the cost: ASCII is printable exactly when it has no control character (``\\x00``-``\\x1f``,
    ``\\x7f``), a tab included, so only a space at either end is left to look at."""
    if text.isascii():
        return text != "" and text.isprintable() and text[0] != " " and text[-1] != " "
    return ID_TEXT_RE.match(text) is not None


def human(pattern: str) -> str:
    """The pattern as error messages show it: without its anchors."""
    return pattern.removeprefix("^").removesuffix("\\Z")
