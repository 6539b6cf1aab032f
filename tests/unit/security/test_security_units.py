"""Pure parts of the trust boundary: token tables, bearer parsing, the new-key cap, the
POLICY_STALE decision, secret-bearing URLs and rollback bundles. No network."""

from __future__ import annotations

import hashlib
import ipaddress
from pathlib import Path

import msgspec
import pytest

from kernel.auth import TokenTable, authenticate, bearer, hash_token, require_region
from kernel.bundle import compute_checksum, load_bundle_file
from kernel.config import ConfigError
from kernel.errors import Forbidden, Unauthorized
from kernel.policy_store import policy_key, rollback_bundle
from region_agent.decision.plan import Snapshot
from region_agent.decision.preauth import NewKeyCap, as_failed_auth
from region_agent.models import AdmitRequest, Principal
from region_agent.service.policy_watch import revoked_decision
from region_agent.service.settings import AgentSettings, redis_url_with_secrets

NORTHSTAR = Path(__file__).resolve().parents[3] / "policies" / "northstar.json"
TOKEN = "s3cret-token-value"


def bundle():
    return load_bundle_file(str(NORTHSTAR))


def test_token_table_matches_only_the_hashed_token():
    t = TokenTable.parse([f"eu:{hash_token(TOKEN)}", f"us=sha256:{hash_token('other')}"])
    assert t.who(TOKEN) == "eu" and t.who("other") == "us" and t.who(TOKEN + "x") is None and t.who("") is None
    with pytest.raises(ConfigError):
        TokenTable.parse([TOKEN])  # a raw token is not a digest
    with pytest.raises(ConfigError):
        TokenTable.parse([f"bad name:{hash_token(TOKEN)}"])


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic abc", f"bearer {TOKEN}",
                                    f"Bearer {TOKEN} extra", "Bearer " + "x" * 600, "Bearer \u00e9\u00e9"])
def test_malformed_authorization_headers_are_401(header):
    t = TokenTable.parse([f"eu:{hash_token(TOKEN)}"])
    headers = [] if header is None else [(b"authorization", header.encode("latin-1"))]
    with pytest.raises(Unauthorized) as e:
        authenticate(t, headers)
    assert e.value.detail == "missing or invalid bearer token"


def test_more_than_one_authorization_header_is_401():
    t = TokenTable.parse([f"eu:{hash_token(TOKEN)}"])
    good = (b"authorization", f"Bearer {TOKEN}".encode())
    assert authenticate(t, [(b"host", b"x"), good]) == "eu"
    for headers in ([good, good], [good, (b"authorization", b"Bearer other")], [(b"Authorization", b"x"), good]):
        with pytest.raises(Unauthorized) as e:
            authenticate(t, headers)
        assert e.value.detail == "missing or invalid bearer token"


def test_bearer_and_region_scope():
    assert bearer([(b"authorization", f"Bearer {TOKEN}".encode())]) == TOKEN
    require_region({}, "eu")  # auth disabled: nothing recorded, nothing refused
    require_region({"leasehold.principal": "eu"}, "eu")
    with pytest.raises(Forbidden):
        require_region({"leasehold.principal": "eu"}, "us")


def test_new_key_cap_ipv6_sources_and_window():
    now = [10.0]
    rule = next(r for r in bundle().rules if r.scope == "ip")
    cap = NewKeyCap(per_source=2, window_ms=60_000, clock=lambda: now[0])
    a = ipaddress.ip_address
    assert cap.admit(a("2001:db8:1:1::1"), rule)
    assert cap.admit(a("2001:db8:1:1::2"), rule)  # same /64: same key
    assert cap.admit(a("2001:db8:1:2::1"), rule)
    assert not cap.admit(a("2001:db8:1:3::1"), rule)  # third /64 inside one /32
    assert cap.admit(a("2001:db9::1"), rule)  # another /32


def test_failed_auth_becomes_an_ip_only_request():
    req = AdmitRequest(request_id="r-00000001", principal=Principal(type="user", id="U-17", api_key_id="K1"),
                       route_group="login", tenant_id="atlas", auth_failed=True, client_ip="203.0.113.9")
    anon = as_failed_auth(req)
    assert (anon.principal.type, anon.principal.id, anon.tenant_id, anon.principal.api_key_id) == \
        ("anonymous", "203.0.113.9", None, None)


def test_revoked_decision_only_for_revocable_rules():
    b = bundle()
    b = msgspec.structs.replace(b, rules=[msgspec.structs.replace(r, revocable=True)
                                          if r.id == "tenant-atlas-minute" else r for r in b.rules])
    atlas = AdmitRequest(request_id="r-00000002", principal=Principal(type="user", id="U-1"), route_group="read",
                         tenant_id="atlas")
    birch = msgspec.structs.replace(atlas, tenant_id="birch")
    d = revoked_decision(Snapshot(b), atlas)
    assert d is not None and (d.allowed, d.http_status, d.reason, d.rule_id) == \
        (False, 503, "POLICY_STALE", "tenant-atlas-minute")
    assert revoked_decision(Snapshot(b), birch) is None


def test_redis_url_gets_the_password_from_env_never_the_flag():
    s = AgentSettings(redis_url="redis://agent@10.0.0.1:6379/0", redis_ca_file="/ca.pem")
    url = redis_url_with_secrets(s, env={"LEASEHOLD_AGENT_REDIS_PASSWORD": "p@ss/word"})
    assert url == "redis://agent:p%40ss%2Fword@10.0.0.1:6379/0?ssl_ca_certs=/ca.pem"
    assert redis_url_with_secrets(AgentSettings(redis_url="redis://h:1/0"), env={}) == "redis://h:1/0"
    # a socket's URL keeps its empty authority (urlunsplit alone wrote unix:/path, refused as no URL)
    sock = AgentSettings(redis_url="unix:///run/redis.sock?db=2")
    assert redis_url_with_secrets(sock, env={}) == "unix:///run/redis.sock?db=2"
    assert redis_url_with_secrets(sock, env={"LEASEHOLD_AGENT_REDIS_PASSWORD": "p/w"}) == \
        "unix://default:p%2Fw@/run/redis.sock?db=2"


def test_rollback_keeps_the_content_checksum():
    b = bundle()
    rolled = rollback_bundle(b, b.bundle_version + 10, "2026-12-01T00:00:00Z")
    assert rolled.bundle_version == b.bundle_version + 10 and rolled.rules == b.rules
    assert rolled.checksum == b.checksum == compute_checksum(b.rules, b.pools, b.max_age_ms)
    assert policy_key("/x/") == b"/x/policy/current" and policy_key("/x") == b"/x/policy/current"
    assert hashlib.sha256(TOKEN.encode()).hexdigest() == hash_token(TOKEN)
