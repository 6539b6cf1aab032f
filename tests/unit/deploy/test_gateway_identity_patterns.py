"""The Envoy files' ``rbac`` refuses a token whose claims no question can carry (decision 0064):
its patterns must be the agent's own, or a claim the agent refuses passes ``rbac`` and its request
passes the fail-open limiter undecided."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from kernel.ids import TENANT_ID, human
from leasehold.local.gateways import PLACEHOLDER
from region_agent.models import ApiKeyId, PrincipalId

GATEWAYS = Path(__file__).resolve().parents[3] / "deploy" / "gateways"


def identified(template: str) -> dict[str, str]:
    """header name -> the regex ``rbac``'s ``identified`` policy requires of it."""
    cfg = yaml.safe_load(PLACEHOLDER.sub("1", (GATEWAYS / template).read_text()))  # any value parses
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    rbac = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.rbac")
    ids = rbac["typed_config"]["rules"]["policies"]["identified"]["principals"][0]["and_ids"]["ids"]
    out: dict[str, str] = {}
    for i in ids:
        for h in [i.get("header")] + [j.get("header") for j in i.get("or_ids", {}).get("ids", ())]:
            if h is not None and "string_match" in h:
                out[h["name"]] = h["string_match"]["safe_regex"]["regex"]
    return out


def max_length(t: object) -> int:
    info = msgspec.inspect.type_info(t)
    assert isinstance(info, msgspec.inspect.StrType) and info.max_length is not None
    return info.max_length


@pytest.mark.parametrize("template", ["envoy-rls.yaml", "envoy-rlqs.yaml", "envoy-ext-authz.yaml"])
def test_rbac_requires_what_the_agent_accepts(template: str):
    assert identified(template) == {
        "x-tenant-id": human(TENANT_ID),
        "x-user-id": f".{{1,{max_length(PrincipalId)}}}",
        "x-api-key-id": f".{{1,{max_length(ApiKeyId)}}}",
    }
