"""kernel.auth: bearer tokens stored as digests; every bad credential gets the same 401."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kernel.auth import SCOPE_KEY, RegionAuth, TokenTable, authenticate, bearer, hash_token, require_region
from kernel.config import ConfigError
from kernel.errors import Forbidden, Unauthorized

EU, US = "s3cret-eu-token", "s3cret-us-token"


def table() -> TokenTable:
    return TokenTable.parse([f"eu:{hash_token(EU)}", f"us = sha256:{hash_token(US).upper()}"])


def h(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in pairs]


def test_a_known_token_names_its_holder_and_others_name_nobody():
    t = table()
    assert len(t) == 2 and t.who(EU) == "eu" and t.who(US) == "us"
    assert t.who("guess") is None and t.who(hash_token(EU)) is None  # the digest itself is not a token


@pytest.mark.parametrize("headers", [
    [],
    h(("authorization", "Basic abc")),
    h(("authorization", "Bearer ")),
    h(("authorization", f"bearer {EU}")),  # the scheme is case-sensitive here
    h(("authorization", f"Bearer {EU} extra")),
    h(("authorization", f"Bearer {EU}"), ("Authorization", f"Bearer {EU}")),  # two headers: refused
    h(("authorization", "Bearer wrong")),
])
def test_every_bad_credential_is_the_same_401(headers):
    with pytest.raises(Unauthorized) as e:
        authenticate(table(), headers)
    assert e.value.detail == "missing or invalid bearer token"


def test_bearer_reads_asgi_bytes_grpc_str_pairs_and_mappings():
    assert bearer(h(("Authorization", f"Bearer {EU}"))) == EU
    assert bearer([("authorization", f"Bearer {US}")]) == US
    assert bearer({"authorization": f"Bearer {EU}"}) == EU


def test_bare_digests_need_a_default_name_and_bad_entries_are_configuration_errors(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# region tokens\n{hash_token(EU)}\n\n")
    assert TokenTable.parse([], str(f), default_name="eu").who(EU) == "eu"
    for bad in ([hash_token(EU)], ["eu:not-hex"], ["bad name!:" + hash_token(EU)]):
        with pytest.raises(ConfigError):
            TokenTable.parse(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        TokenTable.parse([], str(tmp_path / "missing"))


def test_region_auth_records_the_region_and_require_region_refuses_another():
    conn = SimpleNamespace(scope={"headers": h(("authorization", f"Bearer {EU}"))})
    RegionAuth(table())(conn, None)
    assert conn.scope[SCOPE_KEY] == "eu"
    require_region(conn.scope, "eu")
    with pytest.raises(Forbidden):
        require_region(conn.scope, "us")
    require_region({}, "us")  # auth disabled: no check
