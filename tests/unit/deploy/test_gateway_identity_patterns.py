"""The Envoy files' ``rbac`` refuses a token whose claims no question can carry (decision 0064), and
one whose user or API key is no identity text (decision 0078), before any limiter asks about it:
its patterns must be the agent's own, or a claim the agent refuses passes ``rbac`` -- its request
passes the fail-open limiter undecided, or (" admin") is charged and served as another principal."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import yaml

from kernel.ids import ID_TEXT, TENANT_ID, human, is_id_text
from leasehold.local.gateways import PLACEHOLDER
from region_agent.models import ApiKeyId, Principal, PrincipalId

GATEWAYS = Path(__file__).resolve().parents[3] / "deploy" / "gateways"
TEMPLATES = ["envoy-rls.yaml", "envoy-rlqs.yaml", "envoy-ext-authz.yaml"]


def http_filters(template: str) -> list[dict]:
    cfg = yaml.safe_load(PLACEHOLDER.sub("1", (GATEWAYS / template).read_text()))  # any value parses
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"]


def header_patterns(ids: list[dict]) -> dict[str, list[str]]:
    """header name -> the regexes a principal's ``ids`` (nested ``and_ids``/``or_ids``) match it with."""
    out: dict[str, list[str]] = {}
    for i in ids:
        h = i.get("header")
        if h is not None and "string_match" in h:
            out.setdefault(h["name"], []).append(h["string_match"]["safe_regex"]["regex"])
        for nested in ("and_ids", "or_ids"):
            for name, patterns in header_patterns(i.get(nested, {}).get("ids", [])).items():
                out.setdefault(name, []).extend(patterns)
    return out


def keyable(template: str) -> dict[str, list[str]]:
    """header name -> the regexes the first ``rbac`` (right after ``jwt_authn``) requires of it."""
    filters = http_filters(template)
    names = [f["name"] for f in filters]
    first = names.index("envoy.filters.http.rbac")
    assert names[first - 1] == "envoy.filters.http.jwt_authn"  # before the limiter, whatever it is
    assert not {"envoy.filters.http.ratelimit", "envoy.filters.http.ext_authz",
                "envoy.filters.http.rate_limit_quota"} & set(names[:first])
    rules = filters[first]["typed_config"]["rules"]
    assert rules["action"] == "ALLOW" and list(rules["policies"]) == ["keyable"]
    return header_patterns(rules["policies"]["keyable"]["principals"])


def max_length(t: object) -> int:
    info = msgspec.inspect.type_info(t)
    assert isinstance(info, msgspec.inspect.StrType) and info.max_length is not None and info.min_length == 1
    return info.max_length


@pytest.mark.parametrize("template", TEMPLATES)
def test_rbac_requires_what_the_agent_accepts(template: str):
    assert keyable(template) == {
        "x-tenant-id": [human(TENANT_ID)],
        "x-user-id": [f".{{1,{max_length(PrincipalId)}}}", human(ID_TEXT)],
        "x-api-key-id": [f".{{1,{max_length(ApiKeyId)}}}", human(ID_TEXT)],
    }


TEXTS = [" admin", "admin ", "\tadmin", "admin\t", "ad\tmin", "U\x00", "U\x1f", "U\x7f", "U\r\nx: y", " ", "  ",
         "a b", "U-82-Zoë", "x", "~", "!", "\u00a0a", "a\u00a0", "é ", " é", "é\x01", "\u2028", "\x80", "Zoë", "a  b"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_files_pattern_refuses_what_the_agent_refuses(text: str):
    """The files' pattern, as RE2 matches it (the whole value), against the agent's wire type and
    its check without the regex (kernel.ids.is_id_text)."""
    whole = re.fullmatch(human(ID_TEXT), text) is not None
    for principal in ({"type": "user", "id": text}, {"type": "service", "id": "S-1", "apiKeyId": text}):
        try:
            msgspec.convert(principal, Principal)
        except msgspec.ValidationError:
            accepted = False
        else:
            accepted = True
        assert whole == accepted == is_id_text(text), principal


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_last_rbac_asks_only_for_a_tenant_and_a_user(template: str):
    rbacs = [f for f in http_filters(template) if f["name"] == "envoy.filters.http.rbac"]
    assert len(rbacs) == 2
    identified = rbacs[1]["typed_config"]["rules"]["policies"]["identified"]["principals"]
    assert identified == [{"and_ids": {"ids": [{"header": {"name": "x-tenant-id", "present_match": True}},
                                               {"header": {"name": "x-user-id", "present_match": True}}]}}]
