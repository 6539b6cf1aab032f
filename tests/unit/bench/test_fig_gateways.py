"""Figure 8's RLQS baseline: the shipped envoy-rlqs.yaml with its two limit filters removed, and
nothing else (the other variants: test_gateway_variants.py); the rows' servers in alternating order."""

from __future__ import annotations

import re

import yaml

from bench.fig_gateways import RLQS_OFF, _alternated, filter_off
from leasehold.local.gateways import GATEWAY_DIR, render


def http_filters(config: str) -> list[str]:
    doc = yaml.safe_load(config)
    (listener,) = doc["static_resources"]["listeners"]
    return [h["name"] for chain in listener["filter_chains"] for f in chain["filters"]
            for h in f["typed_config"]["http_filters"]]


def test_the_rlqs_baseline_removes_only_the_limit_filters():
    names = set(re.findall(r"\$\{([A-Z_]+)\}", (GATEWAY_DIR / "envoy-rlqs.yaml").read_text()))
    cfg = render("envoy-rlqs.yaml", **{n: "1" for n in names})
    off = cfg
    for f in RLQS_OFF:
        off = filter_off(off, f"envoy.filters.http.{f}")
    gone = {f"envoy.filters.http.{f}" for f in RLQS_OFF}
    before, after = http_filters(cfg), http_filters(off)
    assert gone <= set(before)
    assert after == [h for h in before if h not in gone]
    assert "envoy.filters.http.jwt_authn" in after  # tokens are verified either way
    assert "local_reply_config" not in off


def test_each_rows_servers_run_in_the_opposite_order_every_other_trial():
    ports = {"agent": 1, "bare": 2, "third": 3}
    assert [n for n, _ in _alternated(ports, 0)] == ["agent", "bare", "third"]
    assert [n for n, _ in _alternated(ports, 1)] == ["third", "bare", "agent"]
    assert _alternated(ports, 2) == _alternated(ports, 0)
