"""Figure 8's baselines: the shipped Envoy configs with their limit filters removed, and nothing else."""

from __future__ import annotations

import re

import pytest
import yaml

from leasehold.bench.fig_gateways import LIMIT_FILTERS, filter_off
from leasehold.gateways import GATEWAY_DIR, render


def filled(template: str) -> str:
    names = set(re.findall(r"\$\{([A-Z_]+)\}", (GATEWAY_DIR / template).read_text()))
    return render(template, **{n: "1" for n in names})


def http_filters(config: str) -> list[str]:
    doc = yaml.safe_load(config)
    (listener,) = doc["static_resources"]["listeners"]
    return [h["name"] for chain in listener["filter_chains"] for f in chain["filters"]
            for h in f["typed_config"]["http_filters"]]


@pytest.mark.parametrize("template", ["envoy-rls.yaml", "envoy-rlqs.yaml"])
def test_filter_off_removes_only_the_limit_filters(template: str):
    cfg = filled(template)
    before, after = http_filters(cfg), http_filters(filter_off(cfg))
    assert set(before) & set(LIMIT_FILTERS)
    assert after == [h for h in before if h not in LIMIT_FILTERS]
    assert "envoy.filters.http.jwt_authn" in after  # tokens are verified either way
    assert "local_reply_config" not in filter_off(cfg)
