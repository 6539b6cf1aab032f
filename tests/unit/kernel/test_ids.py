"""kernel.ids: one set of identity patterns, anchored so a trailing newline never passes."""

from __future__ import annotations

import re

import msgspec
import pytest

from kernel import ids


def _patterns() -> dict[str, str]:
    return {name: value for name, value in vars(ids).items()
            if name.isupper() and isinstance(value, str) and value.startswith("^")}


def test_every_pattern_is_anchored_with_backslash_z_and_compiled_alike():
    pats = _patterns()
    assert {"REQUEST_ID", "TENANT_ID", "ROUTE_GROUP", "POOL_ID", "LEASE_ID", "REGION"} <= set(pats)
    for name, pattern in pats.items():
        assert pattern.endswith("\\Z") and not pattern.endswith("$\\Z"), name
        compiled = getattr(ids, name + "_RE", None)
        if compiled is not None:
            assert compiled.pattern == pattern, name


@pytest.mark.parametrize("name, good, bad", [
    ("REQUEST_ID", "r-0001abcd", "r-0001abcd\n"),
    ("REQUEST_ID", "a" * 128, "a" * 129),
    ("REQUEST_ID", "req:1.2_3-x", "short"),
    ("TENANT_ID", "atlas-2", "Atlas"),
    ("ROUTE_GROUP", "read_all", "read all"),
    ("METHOD", "GET", "get"),
    ("POOL_ID", "global-read", "global-read\n"),
    ("LEASE_ID", "eu-0123456789", "eu-01\n"),
    ("REGION", "eu-west-1", "eu_west"),
    ("ETCD_PREFIX", "/leasehold/", "leasehold/"),
    ("OWNER", "team@example", "team example"),
])
def test_patterns_accept_and_refuse(name, good, bad):
    pattern = re.compile(getattr(ids, name))
    assert pattern.search(good) and not pattern.search(bad)


def test_the_annotated_types_carry_the_patterns_to_msgspec():
    class Req(msgspec.Struct):
        request_id: ids.RequestId
        tenant: ids.TenantId

    assert msgspec.json.decode(b'{"request_id": "r-0001abcd", "tenant": "atlas"}', type=Req).tenant == "atlas"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"request_id": "r-0001abcd\\n", "tenant": "atlas"}', type=Req)


def test_human_drops_the_anchors():
    assert ids.human(ids.TENANT_ID) == "[a-z0-9-]{1,32}"
